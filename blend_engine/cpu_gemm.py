"""Whether this CPU multiplies faster in bf16 than in fp32: measured once per machine, kept on disk.

Quantized weights are multiplied, at prefill, by a dequantized copy kept in bf16 or fp32
(blend_engine/int4.py `gemm_dtype`), and auto attention follows that choice (docs/decisions/0023).
The CPU's flags do not tell which is faster. With AMX, bf16 GEMMs ran several times faster than fp32
(stops 48-52). On a VM of the same Xeon generation (model 207) that exposed AVX512-BF16 but not AMX,
oneDNN's bf16 GEMMs ran 1.6-1.9x *slower* than fp32 ones and bf16 attention 1.6x slower at 3 000
tokens (stop 53: docs/decisions/0025). So the choice is measured: a few GEMMs of a prefill's size in
each dtype, about 0.1 s once. The result is kept per machine (the CPU's model and flags, torch's
version) in the model cache directory, so that a restart on a busy machine cannot flip it: the
choice is part of what a chunk's stored KV was computed with.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CACHE_FILE = "cpu-gemm.json"
# bf16 is taken only where clearly faster: a copy that is not, is rounding bought for nothing
MAX_BF16_SHARE = 0.9
NUM_ROWS, NUM_IN, NUM_OUT = 512, 1024, 1024  # a prefill's GEMM: 512 tokens through a 1024 x 1024 weight
NUM_WARMUP, NUM_TIMED = 2, 7


@dataclass(frozen=True)
class GemmTiming:
    """One GEMM of [NUM_ROWS, NUM_IN] x [NUM_IN, NUM_OUT], median ms per dtype, on `num_threads` threads."""

    fp32_ms: float
    bf16_ms: float
    num_threads: int

    @property
    def is_bf16_faster(self) -> bool:
        return self.bf16_ms < MAX_BF16_SHARE * self.fp32_ms


_resolved: dict[str, GemmTiming] = {}  # per process, by machine: the first answer holds for the process
# ModelConfig.gemm_dtype where not auto, set for the process by the loader before it converts the weights (the
# modules read the choice as they are made, as torch's own backend flags are read)
_forced: list[torch.dtype] = []


def force(dtype: torch.dtype | None) -> None:
    """Prefill copies in `dtype` on CPU from now on in this process (None: measured again, auto)."""
    _forced[:] = [] if dtype is None else [dtype]


def forced() -> torch.dtype | None:
    return _forced[0] if _forced else None


@functools.cache  # read once: every quantized layer made asks for the choice
def machine_key() -> str:
    """The CPU's model name and flags, and torch's version: what the measurement depends on."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:  # not Linux: the processor string alone
        pass
    model = fields.get("model name") or platform.processor() or "cpu"
    flags = " ".join(sorted((fields.get("flags") or fields.get("Features") or "").split()))
    digest = hashlib.sha256(f"{model}|{flags}|{torch.__version__}".encode()).hexdigest()[:16]
    return f"{model} / torch {torch.__version__} / {digest}"


def measure() -> GemmTiming:
    """Time the two dtypes' GEMMs in turn (so drift hits both alike); medians."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_ROWS, NUM_IN, generator=generator)
    w = torch.randn(NUM_OUT, NUM_IN, generator=generator)
    inputs = {torch.float32: (x, w), torch.bfloat16: (x.bfloat16(), w.bfloat16())}
    times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in inputs}
    with torch.inference_mode():
        for step in range(NUM_WARMUP + NUM_TIMED):
            for dtype, (a, b) in inputs.items():
                start = time.perf_counter()
                torch.nn.functional.linear(a, b)
                if step >= NUM_WARMUP:
                    times[dtype].append((time.perf_counter() - start) * 1e3)
    return GemmTiming(statistics.median(times[torch.float32]), statistics.median(times[torch.bfloat16]),
                      torch.get_num_threads())


def prefill_dtype(cache_dir: Path | None = None) -> torch.dtype:
    """What prefill multiplies quantized weights in on this CPU: ModelConfig.gemm_dtype where set (`force`),
    else bf16 where native (AVX512-BF16 or AMX) and measured clearly faster than fp32, else fp32. `cache_dir`:
    where this machine's measurement is kept (the loader's; other callers read the process's answer)."""
    if _forced:
        return _forced[0]
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX2 only: never measured
        return torch.float32
    return torch.bfloat16 if bf16_gemm_timing(cache_dir).is_bf16_faster else torch.float32


def bf16_gemm_timing(cache_dir: Path | None = None) -> GemmTiming:
    """This machine's timing: resolved once per process; read from `cache_dir` where it was measured
    before, else measured (and written there when a directory is given)."""
    key = machine_key()
    if key in _resolved:
        return _resolved[key]
    timing = _read(cache_dir, key) if cache_dir is not None else None
    if timing is None:
        timing = measure()
        if cache_dir is not None:  # another process's record, written meanwhile, wins: one choice per machine
            timing = _keep_first(cache_dir, key, timing)
        log.info("CPU GEMMs measured (%s): fp32 %.2f ms, bf16 %.2f ms on %d threads: prefill multiplies in %s",
                 key, timing.fp32_ms, timing.bf16_ms, timing.num_threads,
                 "bf16" if timing.is_bf16_faster else "fp32")
    _resolved[key] = timing
    return timing


def _read(cache_dir: Path, key: str) -> GemmTiming | None:
    try:
        record = json.loads((cache_dir / CACHE_FILE).read_text()).get(key)
        return None if record is None else GemmTiming(**record)
    except (OSError, ValueError, TypeError):  # none yet, or unreadable: measured again
        return None


def _keep_first(cache_dir: Path, key: str, timing: GemmTiming) -> GemmTiming:
    """The machine's record: one already in the file (replicas starting together measure at once, and
    the first to write wins for all), else `timing`, merged into the file beside other machines' records
    and replaced atomically, under a lock. A directory that cannot be written leaves `timing` to this
    process."""
    path = cache_dir / CACHE_FILE
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(cache_dir / f".{CACHE_FILE}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                records = json.loads(path.read_text())
            except (OSError, ValueError):
                records = {}
            if key in records:
                try:
                    return GemmTiming(**records[key])
                except TypeError:  # a record of another shape: replaced
                    pass
            records[key] = asdict(timing)
            fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".cpu-gemm-")
            with os.fdopen(fd, "w") as f:
                json.dump(records, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep the CPU GEMM measurement in %s: %s", path, exc)
    return timing
