"""What a lent GPU machine is asked in one prepared call, `bash bench/device/check.sh` (its dry run on CPU:
tests/test_device_check.py): pack, probe, server, summary; and dispatch counts, a GPU's launches counted on
CPU (docs/benchmarks/gpu.md)."""
