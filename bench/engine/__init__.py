"""How fast is blend, and how close to a full prefill: an engine in this process, no server.

- `prefill`: `ragblend bench engine`, TTFT and fidelity per prefill mode and ratio (variants: `variants`;
  the summary and table: `report`; a weight format against a reference: `formats`; `plot`: its frontier);
- `batch_decode`: one decode step for B sequences (`ragblend bench batch-decode`; the GPU check runs it).

A new engine question goes here as a module of its own beside these (a per-model fidelity bench:
`fidelity.py`; a llama.cpp-vs-ragblend speed bench of the engine alone: `llamacpp.py`), with its
`add_arguments`/`run` pair wired in app/cli.py's COMMANDS and a line in docs/benchmarks/README.md.
"""
