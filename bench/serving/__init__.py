"""Does the server add overhead, and how does it serve many users: `ragblend serve` measured through its
HTTP API (started here by the bench, or one given by --url).

- `server` (+ `report`): `ragblend bench server`, concurrent streaming clients against a one-at-a-time
  baseline; `modes`: `ragblend bench server-modes`, TTFT and fidelity per prefill mode, and throughput;
- `compare` (+ `build`): `ragblend bench compare REV`, this checkout's server against a git revision's;
- `overhead`: the server's blend TTFT and decode against the bare engine's on the same prompts;
- `prefix`: the prefix cache; `replicas`: Postgres against SQLite; `retrieval`: retrieval's latency;
- `memory` (+ `memory_probe`, `memory_stages`): where a server's memory goes.

A speed comparison against another server (llama.cpp's, vLLM's) goes here as a module of its own.
"""
