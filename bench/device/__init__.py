"""What a lent GPU machine is asked, in one prepared call: `bash bench/device/check.sh` (its dry run on CPU:
tests/test_device_check.py; docs/benchmarks/gpu.md says what each step measures and its targets).

- `pack`: what the call carries (tokenizer, embedder config, data, wheels), made here beforehand;
- `probe`: the prefill per mode at 7B/8B shapes, graphed and eager, host time against GPU time;
- `server`: `ragblend serve` end to end on the GPU, with `ragblend bench server` and `server-modes`;
- `summary`: every step's JSON read into the tables and targets the call brings back;
- `dispatch_counts`: torch ops per layer counted on CPU, the stand-in for a GPU's kernel launches.
"""
