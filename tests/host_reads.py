"""Counting what would stall a GPU, on CPU: every read of a device value back to the host, and
every attention call, split into before / inside / after a prefill's layer loop."""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that hand a device value to Python (a host-device sync on CUDA)
HOST_READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "nonzero", "masked_select", "cpu"}
ATTENTION = {"scaled_dot_product_attention", "flex_attention"}


class HostReadCounter(TorchFunctionMode):
    """Counts per phase: 'before' until the embedding runs, 'loop' until the lm_head, then 'after'
    (the final norm may run as torch's fused op, with no module call to hook)."""

    def __init__(self, model):
        super().__init__()
        self.reads: Counter = Counter()
        self.attention: Counter = Counter()
        self.phase = "before"
        decoder = model.get_decoder()
        self._hooks = [
            decoder.embed_tokens.register_forward_pre_hook(lambda *_: self._enter("loop")),
            model.get_output_embeddings().register_forward_pre_hook(lambda *_: self._enter("after")),
        ]

    def _enter(self, phase: str) -> None:
        self.phase = phase

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        is_bool_index = name == "__getitem__" and _has_bool_index(args[1] if len(args) > 1 else None)
        if name in HOST_READS or is_bool_index:
            self.reads[self.phase] += 1
        if name in ATTENTION:
            self.attention[self.phase] += 1
        return func(*args, **(kwargs or {}))


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in items)
