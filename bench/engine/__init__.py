"""How fast is blend, and how close to a full prefill: an engine in this process, no server
(docs/benchmarks/README.md). A new engine question goes here as a module of its own (a per-model fidelity
bench: `fidelity.py`; llama.cpp against ragblend: `llamacpp.py`), wired in app/cli.py's COMMANDS and the map."""
