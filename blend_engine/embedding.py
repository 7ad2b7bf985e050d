"""The token embedding held in int8 blocks where that is exact: a quarter of fp32's bytes, the same values.

A GGUF file ships its embedding block-quantized (SmolLM2's in Q8_0: 32 int8 levels a block, one scale
each; Qwen2.5's in Q4_K, Q5_0 or Q6_K: levels times a scale, plus an offset for Q4_K): every value is
an integer level times its block's scale (plus its offset), computed in fp32. Holding the levels, the
scales and the offsets gives each looked-up row bit for bit as the file's dequantization does
(SmolLM2's 49152 x 576: 108 MB in fp32, 31 MB this way; Qwen2.5-1.5B's 151936 x 1536: 933 MB, 292 MB).
The GGUF loader builds it from the file's blocks (blend_engine/gguf_loader.py); a model directory's
fp32 matrix is checked for Q8_0's form (`exact`), and one that is not such a product (a model trained
in fp32 or bf16, random weights) stays as it is.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK_SIZE = 32  # values sharing a scale: Q8_0's block
MAX_LEVEL = 127
_ROWS_PER_CHECK = 4096  # rows converted at a time: the check's scratch stays small on a large vocabulary


class Int8BlockEmbedding(nn.Module):
    """embedding[v, b*B + j] = qweight[v, b*B + j] * scales[v, b] (+ offsets[v, b]), looked up in fp32;
    B, the block, is hidden / scales.shape[1] (32, or Q6_K's 16)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.block = self.embedding_dim // scales.shape[1]
        self.register_buffer("qweight", qweight)  # [vocab, hidden] int8
        self.register_buffer("scales", scales)  # [vocab, hidden / B] fp32
        self.register_buffer("offsets", offsets)  # [vocab, hidden / B] fp32, or None (symmetric blocks)

    @classmethod
    def exact(cls, weight: torch.Tensor) -> Int8BlockEmbedding | None:
        """`weight` [vocab, hidden] (fp32) as int8 blocks, or None unless every value is recovered exactly."""
        num_rows, dim = weight.shape
        if weight.dtype != torch.float32 or dim % BLOCK_SIZE:
            return None
        qweight = torch.empty(num_rows, dim, dtype=torch.int8, device=weight.device)
        scales = torch.empty(num_rows, dim // BLOCK_SIZE, dtype=torch.float32, device=weight.device)
        for start in range(0, num_rows, _ROWS_PER_CHECK):
            rows = slice(start, start + _ROWS_PER_CHECK)
            blocks = weight[rows].detach().reshape(-1, dim // BLOCK_SIZE, BLOCK_SIZE)  # [r, blocks, 32]
            # Q8_0 sets a block's scale to its largest magnitude / 127, so that value is level +-127
            scale = blocks.abs().amax(-1) / MAX_LEVEL  # [r, blocks]
            levels = torch.round(blocks / torch.where(scale == 0, 1.0, scale)[..., None]).to(torch.int8)
            restored = levels.float() * scale[..., None]  # what a lookup computes
            if not torch.equal(restored.view(torch.int32), blocks.view(torch.int32)):  # bits: -0.0 too
                return None
            qweight[rows] = levels.reshape(-1, dim)
            scales[rows] = scale
        return cls(qweight, scales)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [...] -> [..., hidden] fp32."""
        levels = self.qweight[token_ids].unflatten(-1, (-1, self.block))  # [..., blocks, B] int8
        values = levels.float() * self.scales[token_ids][..., None]
        if self.offsets is not None:
            values = values + self.offsets[token_ids][..., None]
        return values.flatten(-2)

    def dequantized(self, rows: slice = slice(None)) -> torch.Tensor:
        """The matrix's `rows` [r, hidden] fp32, as a lookup computes them."""
        return self.forward(torch.arange(self.num_embeddings)[rows])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 blocks of {self.block}"


def compact_embedding(model: nn.Module) -> bool:
    """Swap the model's input embedding for int8 blocks where they hold it exactly and the lm_head is no
    longer tied to it (a converted lm_head has its own copy); returns whether it was swapped."""
    embedding = model.get_input_embeddings()
    lm_head = model.get_output_embeddings()
    if type(embedding) is not nn.Embedding or embedding.weight.device.type != "cpu" or embedding.max_norm is not None:
        return False
    if lm_head is not None and getattr(lm_head, "weight", None) is embedding.weight:
        return False  # the lm_head multiplies by the same matrix: it stays as loaded
    compact = Int8BlockEmbedding.exact(embedding.weight)
    if compact is None:
        return False
    model.set_input_embeddings(compact)
    return True
