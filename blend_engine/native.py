"""ragblend's own CPU kernel for decode's int4 matmuls, built once per machine with its C++ compiler.

Decode multiplies a few rows by every weight, so its speed is how fast the weights are read. torch's
int4 kernel (`_weight_int4pack_mm_for_cpu`) dequantizes each weight to fp32 first and is bound by that
arithmetic, not by memory: on a 2-core AMD EPYC VM (AVX2) Qwen2.5-1.5B's fused gate/up [17 920 x 1 536]
took 2.11 ms a token from DRAM (~8 GB/s of a measured ~36). csrc/int4_gemv.cpp quantizes the activations
to int8 per group of 32 and takes each group's dot product in integers (AVX2's maddubs/madd, as llama.cpp's
Q4 x Q8 kernels do), applying the weights' scale and zero once per group: 0.745 ms on that VM (23 GB/s).

It is compiled by torch's `cpp_extension` (g++ and ninja) into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) the first time a process asks for it on a
machine (~40 s), and loaded from there afterwards. Where the CPU lacks AVX2, there is no compiler, or
the build fails, decode uses torch's kernel (logged once, with the reason), and `ModelConfig.int4_kernel`
`torch` asks for torch's outright. docs/decisions/0033.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "int4_gemv.cpp"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # -fopenmp: at::parallel_for runs on torch's own OpenMP pool
_CAPABLE = frozenset({"AVX2", "AVX512"})  # torch's names for x86-64 CPUs with AVX2 (every AVX512 one has it)

# x [M, K] fp32, nibbles [N, K/2] uint8, scales_zeros [K/32, N, 2] bf16 -> [M, N] fp32 (csrc/int4_gemv.cpp)
Int4Mm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

_lock = threading.Lock()
_state: dict[str, object] = {}  # "op": the built kernel or None, "why": the reason it is None
_enabled: list[bool] = [True]  # ModelConfig.int4_kernel, set by the loader before it makes the layers


def enable(is_enabled: bool) -> None:
    """Use ragblend's kernel where it builds (True, `int4_kernel: auto`) or torch's always (False); read as
    int4 layers are made, as cpu_gemm's choice is."""
    _enabled[0] = is_enabled


def int4_mm() -> Int4Mm | None:
    """The kernel, built or loaded on the first call in this process; None where it is off or cannot be had."""
    if not _enabled[0]:
        return None
    with _lock:
        if "op" not in _state:
            _state["op"], _state["why"] = _build()
            if _state["op"] is None:
                log.warning("decode's int4 matmuls use torch's kernel: %s", _state["why"])
        return _state["op"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why `int4_mm` gave None in this process (None: it gave the kernel, or was not asked)."""
    return None if not _enabled[0] else _state.get("why")  # type: ignore[return-value]


def _build() -> tuple[Int4Mm | None, str | None]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the kernel is x86-64 AVX2 code; this CPU is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _CAPABLE:
        return None, f"the kernel needs AVX2; torch reports this CPU as {capability}"
    try:
        from torch.utils import cpp_extension

        start = time.perf_counter()
        module = cpp_extension.load("ragblend_int4_gemv", [str(SOURCE)], extra_cflags=_FLAGS,
                                    extra_ldflags=["-fopenmp"], verbose=False)
        log.info("ragblend's int4 decode kernel ready in %.1f s", time.perf_counter() - start)
        return module.int4_mm, None
    except Exception as exc:  # no compiler, no ninja, a failed build: each raises its own type
        return None, f"it could not be built here ({type(exc).__name__}: {str(exc).strip()[:300]})"
