"""ragblend's own CPU kernels for decode's int4 and int8 matmuls and its attention over the int8 cache, built once
per machine with its C++ compiler.

Decode multiplies a few rows by every weight, so its speed is how fast the weights are read. torch's
int4 kernel (`_weight_int4pack_mm_for_cpu`) dequantizes each weight to fp32 first and is bound by that
arithmetic, not by memory: on a 2-core AMD EPYC VM (AVX2) Qwen2.5-1.5B's fused gate/up [17 920 x 1 536]
took 2.11 ms a token from DRAM (~8 GB/s of a measured ~36). csrc/int4_gemv.cpp quantizes the activations
to int8 per group of 32 and takes each group's dot product in integers (AVX2's maddubs/madd, as llama.cpp's
Q4 x Q8 kernels do), applying the weights' scale and zero once per group: 0.745 ms on that VM (23 GB/s).
csrc/int8_gemv.cpp does the same for int8 weights (a GGUF's Q5/Q6_K/Q8_0 layers and the int8 lm_head), where
torch's `_weight_int8pack_mm` read the 1.5B's lm_head [151 936 x 1 536] at ~15 GB/s on that VM.
csrc/int8_attention.cpp attends one token over a layer of the int8 decode cache in one call, and writes its new
K/V there, rounding exactly where torch's path rounds (bit for bit where torch runs its AVX2 kernel): at 3k
tokens the 1.5B's 28 layers took 8.1 ms against torch's 16.8. csrc/rms_norm.cpp is torch's `F.rms_norm` of fp32
rows bit for bit in one call, where torch makes eight (~45 us a row inside a decode step, 57 rows a step).

It is compiled by torch's `cpp_extension` (g++ and ninja) into a folder of torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) named by a digest of its path, sources and flags, the
first time a process asks for it on a machine (~100 s on 2 cores), and loaded from there afterwards. Where
the CPU lacks AVX2, there is no compiler, or the build fails, decode uses torch's kernels (logged once, with
the reason), and `ModelConfig.decode_kernel` `torch` asks for torch's outright. docs/decisions/0033, 0034,
0035, 0036 and 0037.

Builders take turns on an `flock` beside that folder, which the kernel lets go of when its holder dies. torch's
own turn-taking is a `lock` file that a killed builder leaves behind, and every later process waits on it
forever: a builder holding the flock deletes such a file, and a process that waits longer than
`BUILD_WAIT_S` for the flock goes on with torch's kernels.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("module.cpp", "int4_gemv.cpp", "int8_gemv.cpp",
                                                            "int8_attention.cpp", "rms_norm.cpp")]
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # -fopenmp: at::parallel_for runs on torch's own OpenMP pool
BUILD_WAIT_S = 900.0  # the longest a process waits for another's build (one takes ~100 s on 2 cores)
_CAPABLE = frozenset({"AVX2", "AVX512"})  # torch's names for x86-64 CPUs with AVX2 (every AVX512 one has it)

# csrc/int4_gemv.cpp: x [M, K] fp32, nibbles [N/8, K*4] uint8, block_scales [N/8, K/32, 8, 2] bf16 -> [M, N] fp32
# csrc/int8_gemv.cpp: x [M, K] fp32, q [N, K] int8, scales [N] bf16 -> [M, N] fp32
Mm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# csrc/int8_attention.cpp: q [H_kv, G, D] bf16, keys [H_kv, N, D] int8, key_scales [H_kv, N] bf16, values_t
# [H_kv, D, C] int8, value_scales [H_kv, N] bf16, bias [N] or None -> [H_kv, G, D] bf16
# csrc/int8_attention.cpp: k, v [H_kv, n, D] fp32 into keys [H_kv, C, D] int8, key_scales [H_kv, C] bf16, values_t
# [H_kv, D, C] int8, value_scales [H_kv, C] bf16 at slots start .. start + n
# csrc/rms_norm.cpp: x [M, D] fp32, weight [D] fp32, eps -> [M, D] fp32
RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# the widths it takes: torch sums rows under 8 without vectors, and splits one row's sum over its threads from
# 32 768 elements (TensorIterator's grain), each a different order of additions
RMS_NORM_WIDTHS = (8, 32768)
Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], None]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                     torch.Tensor]


class Kernels(Protocol):
    """The built extension module (csrc/module.cpp)."""

    int4_mm: Mm
    int8_mm: Mm
    int8_attention: Attention
    int8_write: Write
    rms_norm: RmsNorm


_lock = threading.Lock()
_state: dict[str, object] = {}  # "module": the built kernels or None, "why": the reason it is None
_enabled: list[bool] = [True]  # ModelConfig.decode_kernel, set by the loader before it makes the layers


def enable(is_enabled: bool) -> None:
    """Use ragblend's kernels where they build (True, `decode_kernel: auto`) or torch's always (False); read
    as quantized layers are made, as cpu_gemm's choice is."""
    _enabled[0] = is_enabled


def int4_mm() -> Mm | None:
    """The int4 kernel, built or loaded on the first call in this process; None where off or not to be had."""
    return cast("Mm | None", _op("int4_mm"))


def int8_mm() -> Mm | None:
    """The int8 kernel, as `int4_mm`."""
    return cast("Mm | None", _op("int8_mm"))


def int8_attention() -> Attention | None:
    """Decode's attention over the int8 cache (csrc/int8_attention.cpp), as `int4_mm`."""
    return cast("Attention | None", _op("int8_attention"))


def int8_write() -> Write | None:
    """Decode's write of new K/V into the int8 cache (csrc/int8_attention.cpp), as `int4_mm`."""
    return cast("Write | None", _op("int8_write"))


def rms_norm() -> RmsNorm | None:
    """RMSNorm of fp32 rows, torch's `F.rms_norm` bit for bit (csrc/rms_norm.cpp), as `int4_mm`."""
    return cast("RmsNorm | None", _op("rms_norm"))


def _op(name: str) -> object | None:
    """The built module's function `name`, or None where the kernels are off or not to be had."""
    module = _module()
    return None if module is None else getattr(module, name)


def unavailable_reason() -> str | None:
    """Why the kernels are None in this process (None: they were had, or not asked for)."""
    return None if not _enabled[0] else _state.get("why")  # type: ignore[return-value]


def _module() -> Kernels | None:
    if not _enabled[0]:
        return None
    with _lock:
        if "module" not in _state:
            _state["module"], _state["why"] = _build()
            if _state["module"] is None:
                log.warning("decode uses torch's kernels and RMSNorm: %s", _state["why"])
        return _state["module"]  # type: ignore[return-value]


def _build() -> tuple[Kernels | None, str | None]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the kernels are x86-64 AVX2 code; this CPU is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _CAPABLE:
        return None, f"the kernels need AVX2; torch reports this CPU as {capability}"
    try:
        from torch.utils import cpp_extension

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(directory.with_suffix(".flock"), "a") as turn:
            if not _take_turn(turn.fileno(), BUILD_WAIT_S):
                return None, (f"another process has held the build of the kernels in {directory} for over "
                              f"{BUILD_WAIT_S:.0f} s")
            # every builder holds the flock first, so a `lock` file seen while holding it is a dead builder's
            (directory / "lock").unlink(missing_ok=True)
            module = cpp_extension.load("ragblend_decode_gemv", [str(path) for path in SOURCES], extra_cflags=_FLAGS,
                                        extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
        log.info("ragblend's decode kernels ready in %.1f s", time.perf_counter() - start)
        return cast(Kernels, module), None
    except Exception as exc:  # no compiler, no ninja, a failed build: each raises its own type
        return None, f"it could not be built here ({type(exc).__name__}: {str(exc).strip()[:300]})"


def build_directory() -> Path:
    """The folder the kernels are built in: one per checkout and state of its sources, flags, torch, Python and
    ninja, so that another build (another checkout, an older release) neither waits on nor overwrites this one.
    The checkout's path counts because ninja's build file names the sources by path: two checkouts of the same
    sources in one folder rebuilt each other's objects at every process's first load (~100 s each). The ninja
    on PATH counts because two versions keep their logs in formats the other cannot read and then rebuild
    everything: Debian's 1.11 and the venv's 1.13 took turns so (a process started with the venv's bin on
    PATH, then one without)."""
    from torch.utils import cpp_extension

    csrc = Path(__file__).resolve().parent / "csrc"
    ninja = shutil.which("ninja")  # the one torch's build runs (by PATH)
    digest = hashlib.sha256(f"{csrc}\0{Path(ninja).resolve() if ninja else None}".encode())
    for path in sorted(csrc.iterdir()):  # the headers too
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join([*_FLAGS, torch.__version__, sys.version]).encode())
    return Path(cpp_extension.get_default_build_root()) / f"ragblend_kernels_{digest.hexdigest()[:16]}"


def _take_turn(fd: int, wait_s: float) -> bool:
    """Hold an exclusive flock on `fd`, waiting up to `wait_s`: False if it was not had by then."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)
