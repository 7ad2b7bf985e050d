"""What a lent GPU machine is asked in one prepared call, `bash bench/device/check.sh` (its dry run on CPU:
tests/test_device_check.py): pack, probe, server, summary (docs/benchmarks/gpu.md). A GPU's launches counted on
CPU moved to tests/dispatch_counts.py in issue 64."""
