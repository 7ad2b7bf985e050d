"""Token selection for blend mode: which cached tokens deviate most from a fresh computation."""

from __future__ import annotations

import torch


def token_deviation(fresh: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """Squared L2 distance per token over heads and head dims: [H, n, D] x2 -> [n] (float32).

    K is compared before RoPE: the rotation is orthogonal, so the distance is the same as at any
    common position, and no rotation is spent on tokens that are then dropped.
    """
    return (fresh.float() - reused.float()).pow(2).sum(dim=(0, 2))


def select_top(deviation: torch.Tensor, num_keep: int) -> torch.Tensor:
    """Indices of the `num_keep` largest deviations, ascending by index."""
    if num_keep <= 0:
        return torch.empty(0, dtype=torch.long, device=deviation.device)
    return torch.topk(deviation, num_keep, sorted=False).indices.sort().values
