"""Token selection for blend mode: which cached tokens deviate most from a fresh computation."""

from __future__ import annotations

import torch

from configs.enums import HeadReduce, ScoreCombine


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


def query_mass(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float,
               heads: HeadReduce = HeadReduce.SUM, num_last: int = 0) -> torch.Tensor:
    """Attention mass each key receives from the question's tokens: summed over the tokens (the last
    `num_last` only, when > 0), then summed or maxed over heads.

    q [H, S, D] (rotated) over keys [H_kv, N, D]; mask [G*S, N] additive (0 / -inf), the query heads
    of each KV head folded into rows as in the masked attention. Returns [N] (float32).
    """
    num_heads, num_query, head_dim = q.shape
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    folded = q.float().reshape(num_kv_heads, group * num_query, head_dim)
    scores = folded @ keys.float().transpose(1, 2) * scale + mask  # [H_kv, G*S, N]
    probs = torch.softmax(scores, dim=-1).reshape(num_heads, num_query, -1)  # [H, S, N]; head h = kv h//G, g h%G
    if 0 < num_last < num_query:
        probs = probs[:, -num_last:]
    per_head = probs.sum(dim=1)  # [H, N]
    return per_head.amax(dim=0) if heads == HeadReduce.MAX else per_head.sum(dim=0)


def combine_scores(mass: torch.Tensor, deviation: torch.Tensor, combine: ScoreCombine) -> torch.Tensor:
    """[C] one ranking score (>= 0) from the question's attention mass and the deviation, both [C]."""
    if combine == ScoreCombine.PRODUCT:
        return mass * deviation
    return (mass.argsort().argsort() + deviation.argsort().argsort()).float()  # ranks 0..C-1, summed
