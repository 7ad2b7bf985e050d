"""The engine-side serving runtime: one thread runs the engine (`EngineLoop`), a `Scheduler` decides what
each step runs (prefills under a token budget, one batched decode step for every running sequence, one
exclusive job or background unit), and `PrefillExecutor` turns a request's prompt into a prefill. No HTTP
here: app/ submits work and reads what it emits."""
