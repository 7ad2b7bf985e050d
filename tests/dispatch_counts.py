"""Torch ops dispatched per layer, counted on CPU: a stand-in for a GPU's kernel launches that
tests/test_dispatch_counts.py holds under bounds (docs/benchmarks/gpu.md#torch-ops-per-layer-counted-on-cpu).
Each figure is (ops of MANY_LAYERS layers - ops of FEW_LAYERS) / the layers between, so per-request work
cancels; host syncs are counted apart (none may come per layer). It was `python -m bench.device.dispatch_counts`
until issue 64 (its table: `git show 50937cd:bench/device/dispatch_counts.py`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from enum import Enum

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from blend_engine.attention import AttentionBackend
from blend_engine.engine import BlendEngine
from blend_engine.types import BlendConfig, PrefillMode, SamplingParams, Segment
from engine_models import VOCAB

FEW_LAYERS, MANY_LAYERS = 4, 12
SYNC_OPS = frozenset({"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                      "aten.item.default", "aten._assert_async.msg"})
BLEND = BlendConfig.cacheblend(recompute_ratio=0.15, check_layers=(1,))
GRAPH_REPLAY = "graph replay"


class OpCounter(TorchDispatchMode):
    """Every aten op dispatched while active, by name; inside `paused()` ops are left out and the
    pause is counted as one "graph replay" op (what a CUDA graph replays: one launch for all)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.is_paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.is_paused:
            name = str(func)
            if name == "aten.index.Tensor" and any(
                    isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else [])):
                name = "aten.index.Tensor(bool)"
            if func.is_view:
                name += "(view)"
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.ops[GRAPH_REPLAY] += 1
        was, self.is_paused = self.is_paused, True
        try:
            yield
        finally:
            self.is_paused = was


@dataclass(frozen=True)
class Count:
    ops: float  # every dispatched op, views included
    launches: float  # ops that are not views: a kernel launch each on a GPU
    syncs: float  # host syncs

    @classmethod
    def of(cls, ops: Counter[str]) -> Count:
        total = sum(ops.values())
        views = sum(n for name, n in ops.items() if name.endswith("(view)"))  # a replay counts as a launch
        syncs = sum(n for name, n in ops.items() if name in SYNC_OPS or name.endswith("(bool)"))
        return cls(total, total - views, syncs)

    def per_layer(self, fewer: Count, num_layers: int) -> Count:
        return Count(*((a - b) / num_layers for a, b in zip(astuple(self), astuple(fewer))))


def tiny_engine(num_layers: int, seed: int = 0) -> BlendEngine:
    """A random Llama with GQA (hidden 64, 4 heads, 2 KV heads), fp32 on CPU, as engine_models.py's."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=4096)
    return BlendEngine.from_model(LlamaForCausalLM(config).eval(), name=f"tiny-{num_layers}", blend=BLEND)


def prompt(engine: BlendEngine, num_chunks: int = 5, chunk_tokens: int = 120) -> list[Segment]:
    """[prefix, chunk x num_chunks (cached), question], the ids from a seeded generator."""
    generator = torch.Generator().manual_seed(1)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, VOCAB, (n,), generator=generator).tolist())

    segments = [Segment(ids(8))]
    for _ in range(num_chunks):
        chunk = ids(chunk_tokens)
        segments.append(Segment(chunk, engine.precompute(chunk)))
    return segments + [Segment(ids(12))]


Setup = Callable[[BlendEngine], Callable[[], object]]


def counted(engine: BlendEngine, setup: Setup, counter_hook: Callable[[BlendEngine, OpCounter], None] | None = None
            ) -> Counter[str]:
    """The ops of one call of what `setup(engine)` returns, after a warm-up call."""
    run = setup(engine)
    run()
    with OpCounter() as counter:
        if counter_hook is not None:
            counter_hook(engine, counter)
        run()
    return counter.ops


class Path(str, Enum):
    """Which of the engine's paths a count follows (all of them run here, on CPU)."""

    CPU = "cpu"  # the engine as it runs on CPU: reused KV laid out layer by layer, grouped attention
    GPU = "gpu"  # as on CUDA: the reused KV laid out before the loop, one masked attention call a layer
    GPU_GRAPHED = "gpu, graphed"  # and the layers past the check from a prefill bucket's graphs


def as_on(engine: BlendEngine, path: Path) -> BlendEngine:
    """`engine` (a CPU one) set to run `path`."""
    if path is not Path.CPU:
        engine.is_bulk_layout = True
        engine.attention_backend = AttentionBackend.MASKED
    engine.is_prefill_graphed = path is Path.GPU_GRAPHED
    return engine


def per_layer(setup: Setup, path: Path = Path.CPU) -> Count:
    """One layer's ops of `setup`'s call: (MANY_LAYERS' - FEW_LAYERS') / the layers between, on `path`.
    Graphed, what the graphs would replay is left out and each replay counts as one launch: the ops
    a GPU would still launch one by one."""
    counts = []
    for num_layers in (FEW_LAYERS, MANY_LAYERS):
        engine = as_on(tiny_engine(num_layers), path)
        hook = _pause_in_graphs if path is Path.GPU_GRAPHED else None
        counts.append(Count.of(counted(engine, setup, hook)))
    return counts[1].per_layer(counts[0], MANY_LAYERS - FEW_LAYERS)


def _pause_in_graphs(engine: BlendEngine, counter: OpCounter) -> None:
    engine.prefill_graphs.replay_scope = counter.paused


def prefill(mode: PrefillMode) -> Setup:
    def setup(engine: BlendEngine) -> Callable[[], object]:
        segments = prompt(engine)
        return lambda: engine.prefill(segments, mode, BLEND, max_new_tokens=8)
    return setup


def decode_step(engine: BlendEngine) -> Callable[[], object]:
    """One `decode_step` of one sequence (fp32: over the prefill's own cache, eagerly on CPU)."""
    result = engine.prefill(prompt(engine, num_chunks=2, chunk_tokens=40), PrefillMode.FULL, max_new_tokens=64)
    sequence, _ = engine.start_sequence(result, SamplingParams(max_tokens=60, is_eos_ignored=True))
    return lambda: engine.decode_step([sequence])


def batch_decode_step(engine: BlendEngine) -> Callable[[], object]:
    """One `decode_step` of four sequences (the eager batched step)."""
    sequences = []
    for seed in range(4):
        result = engine.prefill(prompt(engine, num_chunks=1, chunk_tokens=30 + seed), PrefillMode.FULL,
                                max_new_tokens=64)
        sequences.append(engine.start_sequence(result, SamplingParams(max_tokens=60, is_eos_ignored=True))[0])
    return lambda: engine.decode_step(sequences)


def all_counts() -> dict[str, Count]:
    """Every figure docs/benchmarks/gpu.md gives, by name."""
    counts = {}
    for mode in (PrefillMode.BLEND, PrefillMode.REUSE, PrefillMode.FULL):
        for path in Path:
            counts[f"{mode.value} prefill, {path.value}"] = per_layer(prefill(mode), path)
    counts["decode step (B = 1, eager)"] = per_layer(decode_step)
    counts["batched decode step (B = 4, eager)"] = per_layer(batch_decode_step)
    return counts

