"""Does the server add overhead, and how does it serve many users: `ragblend serve` through its HTTP API
(docs/benchmarks/README.md lists each bench: server, modes, compare, retrieval, memory).
A speed comparison against another server (llama.cpp's, vLLM's) goes here as a module of its own."""
