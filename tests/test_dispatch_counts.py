"""Torch ops dispatched per layer (dispatch_counts.py), held under bounds: on a GPU each op that is
not a view is a kernel launch, and a 7B prefill was measured bound by them (docs/benchmarks/gpu.md).
Each bound is the count when it was set plus a small margin: a change that adds ops to every layer
fails here, and says by how many. No host sync may come per layer, on any path."""

import pytest
import torch

from dispatch_counts import Count, Path, all_counts

# name -> (ops, launches): the counts of docs/benchmarks/gpu.md ("Torch ops per layer") plus a margin
BOUNDS = {
    "blend prefill, cpu": (120, 48),  # 116, 46: the reused KV of 5 chunks laid out layer by layer (136, 56 before
    # the keys were rotated in place: blend_engine/layer.py rotate_into)
    "blend prefill, gpu": (48, 22),  # 46, 21
    "blend prefill, gpu, graphed": (26, 7),  # 24, 6: 2 graph replays, the K/V writes, the attention, a copy
    "reuse prefill, cpu": (120, 48),
    "reuse prefill, gpu": (48, 22),
    "reuse prefill, gpu, graphed": (26, 7),
    "full prefill, cpu": (48, 22),  # 46, 21
    "full prefill, gpu": (48, 22),
    "full prefill, gpu, graphed": (26, 7),
    "decode step (B = 1, eager)": (44, 22),  # 42, 21 (on CUDA the step is one graph: none per layer)
    "batched decode step (B = 4, eager)": (110, 33),  # 106, 31
}


@pytest.fixture(scope="module")
def counts() -> dict[str, Count]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return all_counts()
    finally:
        torch.set_num_threads(previous)


def test_every_path_is_counted_and_bounded(counts):
    assert set(counts) == set(BOUNDS)
    assert {name.split(", ", 1)[1] for name in counts if "prefill" in name} == {p.value for p in Path}


@pytest.mark.parametrize("name", list(BOUNDS))
def test_ops_per_layer_stay_under_their_bound(counts, name):
    count, (max_ops, max_launches) = counts[name], BOUNDS[name]
    assert count.launches <= max_launches, f"{name}: {count.launches:g} launches a layer, bound {max_launches}"
    assert count.ops <= max_ops, f"{name}: {count.ops:g} ops a layer, bound {max_ops}"
    assert count.syncs == 0, f"{name}: {count.syncs:g} host syncs a layer"


def test_the_graphs_leave_a_fraction_of_the_launches(counts):
    for mode in ("blend", "reuse", "full"):
        eager, graphed = counts[f"{mode} prefill, gpu"], counts[f"{mode} prefill, gpu, graphed"]
        assert graphed.launches <= eager.launches / 3
