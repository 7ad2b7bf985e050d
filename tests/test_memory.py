"""What keeps an idle server's memory down (docs/benchmarks/memory.md), each on something small:
the embedding in exact int8 blocks, the checkpoint's file mapping released once converted, the
lm_head's prefill copy made only when first needed, the allocator's free memory given back when the
engine loop idles (once per idle spell, never while it works), the last step not held while idle,
numba never loaded, the file parsers imported only when needed, oneDNN's caches bounded by `ragblend`.
(An idle `ragblend serve` with the real model: tests/test_server_memory.py.)"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer

from blend_engine import int4
from blend_engine.config import BlendConfig, ModelConfig
from blend_engine.embedding import Int8BlockEmbedding, compact_embedding
from blend_engine.engine import BlendEngine
from blend_engine.int4 import widened
from blend_engine.loader import embedded_gguf_path, embedded_tokenizer_dir, load_model
from blend_engine.types import PrefillMode, Segment
from blend_engine.weights import MAX_PACKED_ROWS, Int8Linear, convert_linears
from configs.enums import WeightFormat
from runtime.config import SchedulerConfig
from runtime.loop import EngineLoop
from runtime.memory import release_free_memory
from tests.engine_models import MODEL_BUILDERS

REPO_ROOT = Path(__file__).resolve().parents[1]


def q8_0_like(rows: int, dim: int, seed: int = 0) -> torch.Tensor:
    """What a Q8_0 embedding dequantizes to: int8 levels times an fp16 scale per block of 32."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(-127, 128, (rows, dim // 32, 32), generator=g).float()
    levels[..., 0] = 127  # a block's largest magnitude is level 127, as Q8_0 sets its scale
    scales = (torch.rand(rows, dim // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    return (levels * scales).reshape(rows, dim)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


# ---- the embedding --------------------------------------------------------------------------------


def test_int8_blocks_hold_a_q8_0_embedding_bit_for_bit():
    weight = q8_0_like(300, 64)
    compact = Int8BlockEmbedding.exact(weight)
    assert compact is not None and compact.qweight.dtype == torch.int8
    ids = torch.tensor([[0, 5, 299], [7, 7, 1]])
    looked_up = compact(ids)
    assert looked_up.dtype == torch.float32 and looked_up.shape == (2, 3, 64)
    assert torch.equal(looked_up.view(torch.int32), nn.functional.embedding(ids, weight).view(torch.int32))
    assert compact.qweight.nbytes + compact.scales.nbytes < weight.nbytes / 3


def test_a_matrix_not_made_of_int8_blocks_stays_as_it_is():
    assert Int8BlockEmbedding.exact(torch.randn(64, 64)) is None  # trained or random weights
    weight = q8_0_like(64, 64)
    weight[63, 5] = torch.nextafter(weight[63, 5], torch.tensor(1.0))  # one value off by one ulp
    assert Int8BlockEmbedding.exact(weight) is None
    weight = q8_0_like(64, 64)
    weight[3, 7] = -0.0  # a negative zero a lookup would give back as +0.0
    assert Int8BlockEmbedding.exact(weight) is None
    assert Int8BlockEmbedding.exact(q8_0_like(64, 64).bfloat16()) is None


def test_a_compacted_embedding_changes_no_logit():
    """The tiny Llama with a Q8_0-like embedding, int8 layers (so its lm_head has its own copy):
    compacted, every logit of a prefill and of HF's own forward is what it was, bit for bit."""
    torch.manual_seed(0)
    model = MODEL_BUILDERS["llama-gqa"]().eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(q8_0_like(*model.get_input_embeddings().weight.shape))
    convert_linears(model, WeightFormat.INT8)
    ids = torch.arange(3, 40)
    engine = BlendEngine.from_model(model, name="llama", blend=BlendConfig.cacheblend())
    before = engine.prefill([Segment(tuple(ids.tolist()))], PrefillMode.FULL).logits
    with torch.inference_mode():
        hf_before = model(ids[None]).logits
    assert compact_embedding(model) and isinstance(model.get_input_embeddings(), Int8BlockEmbedding)
    engine = BlendEngine.from_model(model, name="llama", blend=BlendConfig.cacheblend())
    assert torch.equal(engine.prefill([Segment(tuple(ids.tolist()))], PrefillMode.FULL).logits, before)
    with torch.inference_mode():
        assert torch.equal(model(ids[None]).logits, hf_before)


def test_an_embedding_the_lm_head_still_multiplies_by_is_not_compacted():
    model = MODEL_BUILDERS["llama-gqa"]().eval()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(q8_0_like(*model.get_input_embeddings().weight.shape))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert not compact_embedding(model)  # fp32 layers: the tied lm_head reads the matrix itself


# ---- loading: the checkpoint's mapping released, the lm_head's copy on demand -------------------


def test_a_converted_checkpoint_leaves_no_mapping_of_its_file(tmp_path):
    """A model directory loaded in int4: once converted, no page of its safetensors file stays mapped
    (all of it did: SmolLM2's 513 MB), and its embedding is in int8 blocks where they hold it exactly."""
    torch.manual_seed(0)
    model = MODEL_BUILDERS["llama-gqa"]()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(q8_0_like(*model.get_input_embeddings().weight.shape))
    model.save_pretrained(tmp_path)
    embedded = embedded_tokenizer_dir(ModelConfig().cache_dir)
    AutoTokenizer.from_pretrained(embedded).save_pretrained(tmp_path)  # any tokenizer: the ids are not fed
    weights = tmp_path / "model.safetensors"
    assert weights.is_file()
    loaded = load_model(ModelConfig(name=str(tmp_path), weights=WeightFormat.INT4))
    gc.collect()
    assert str(weights) not in Path("/proc/self/maps").read_text()
    assert isinstance(loaded.model.get_input_embeddings(), Int8BlockEmbedding)
    # the fp32 format converts nothing: its weights are the mapping, left as they are
    fp32 = load_model(ModelConfig(name=str(tmp_path), weights=WeightFormat.FP32))
    assert str(weights) in Path("/proc/self/maps").read_text()
    assert type(fp32.model.get_input_embeddings()) is nn.Embedding


def test_the_lm_head_makes_its_prefill_copy_at_its_first_call_with_many_rows():
    """The int8 lm_head (SmolLM2's largest matrix) keeps no bf16 copy until a call with more than 32
    rows (teacher forcing, a batch of over 32 answers); the decoder's layers keep theirs."""
    model = MODEL_BUILDERS["llama-gqa"]().eval()
    convert_linears(model, WeightFormat.INT8)
    lm_head, layer = model.get_output_embeddings(), model.model.layers[0].mlp.down_proj
    assert isinstance(lm_head, Int8Linear) and lm_head.gemm_weight is None
    assert layer.gemm_weight is not None or not layer.is_bf16_gemm
    few = torch.randn(MAX_PACKED_ROWS, 64)
    lm_head(few)
    assert lm_head.gemm_weight is None  # the int8 kernel's rows
    many = torch.randn(MAX_PACKED_ROWS + 1, 64)
    out = lm_head(many)
    kept = Int8Linear(lm_head.qweight, lm_head.scales, None)  # the same weights, copy made up front
    assert torch.equal(out, kept(many))
    if lm_head.is_bf16_gemm:
        assert lm_head.gemm_weight is not None and torch.equal(lm_head.gemm_weight, kept.gemm_weight)


# ---- the allocator and the engine loop ----------------------------------------------------------


def test_release_gives_freed_heap_pages_back():
    """64 kB blocks come from malloc's heap; freed, all but the last, they stay resident (the heap's
    top is in use) until the release."""
    blocks = [bytearray(64 << 10) for _ in range(3000)]  # ~190 MB, every page touched (zeroed)
    last = blocks[-1]
    del blocks
    gc.collect()
    before = rss_mb()
    assert release_free_memory()
    assert before - rss_mb() > 100, f"RSS {before:.0f} -> {rss_mb():.0f} MB"
    del last


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_loop_releases_once_per_idle_spell_after_work():
    async def main():
        loop = EngineLoop(None, None, SchedulerConfig(idle_release_s=0.2))
        try:
            time.sleep(0.5)
            assert loop.stats.num_idle_releases == 0  # no work yet: nothing to give back
            await loop.run(lambda job: None)
            assert _wait_for(lambda: loop.stats.num_idle_releases == 1)
            time.sleep(0.5)
            assert loop.stats.num_idle_releases == 1  # once a spell
            for _ in range(5):  # work arriving more often than the delay: no release in between
                await loop.run(lambda job: None)
                time.sleep(0.05)
            assert loop.stats.num_idle_releases == 1
            assert _wait_for(lambda: loop.stats.num_idle_releases == 2)
        finally:
            loop.close()
        never = EngineLoop(None, None, SchedulerConfig(idle_release_s=0))
        try:
            await never.run(lambda job: None)
            time.sleep(0.3)
            assert never.stats.num_idle_releases == 0
        finally:
            never.close()

    asyncio.run(main())


def test_an_idle_release_drops_the_prefill_scratch_of_the_loop_thread():
    """Prefill's fp32 GEMM scratch (the largest layer's: 110 MB for the 1.5B) is given back with the rest at an
    idle release, and made again by the next prefill, whose result does not change."""
    weight = torch.randn(64, 96).bfloat16()

    def scratch(job):  # runs on the loop's thread: its scratch's address, or None where it has none
        buffer = getattr(int4._scratch, "buffer", None)
        return None if buffer is None else buffer.data_ptr()

    async def main():
        loop = EngineLoop(None, None, SchedulerConfig(idle_release_s=0.2))
        try:
            first = await loop.run(lambda job: widened(weight).clone())
            assert torch.equal(first, weight.float())
            assert await loop.run(scratch) is not None
            assert _wait_for(lambda: loop.stats.num_idle_releases == 1)
            assert await loop.run(scratch) is None
            assert torch.equal(await loop.run(lambda job: widened(weight).clone()), first)
        finally:
            loop.close()

    asyncio.run(main())


def test_an_idle_loop_holds_nothing_of_its_last_step():
    """What the last step's work referenced (a finished answer's prefill cache) is freed when it ends,
    not when the next request comes."""
    class Payload:
        pass

    async def main():
        loop = EngineLoop(None, None, SchedulerConfig(idle_release_s=0))
        try:
            payload = Payload()
            alive = weakref.ref(payload)

            def work(job, held=payload):
                return None

            await loop.run(work)
            del work, payload
            assert _wait_for(lambda: (gc.collect(), alive() is None)[1], 2.0)
        finally:
            loop.close()

    asyncio.run(main())


# ---- what is imported when, and the cache bounds -----------------------------------------------


def _run_python(code: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_server_never_loads_numba_and_loads_the_file_parsers_only_when_needed(tmp_path):
    """A low-bit store writes and reads its entries without numba and LLVM (~117 MB once loaded: the
    decoder is numpy and torch since stop 45, docs/benchmarks/memory.md); PDF, DOCX and HTML parsers load
    with their first file."""
    code = f"""
import json, sys, torch
import app.main
from blend_engine.kv import ChunkKV, KVShape
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig
out = {{"at_import": sorted(m for m in ("numba", "llvmlite", "pypdf", "docx", "trafilatura") if m in sys.modules)}}
config = StoreConfig(disk_dir={str(tmp_path / "kv")!r}, quantization=KVQuantization.INT4, dtype=StorageDtype.FLOAT16,
                     max_memory_bytes=0, fsync=False)
shape = KVShape(num_layers=2, num_kv_heads=2, head_dim=64)
store = KVStore("fp", config, shape=shape)
kv = ChunkKV(tuple(range(40)), (), torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64))
store.put(store.key_for(kv.token_ids, kv.context_ids), kv)
got = store.get(store.key_for(kv.token_ids, kv.context_ids))
out["read"] = got is not None and got.keys.shape == kv.keys.shape
out["after_a_write_and_read"] = sorted(m for m in ("numba", "llvmlite") if m in sys.modules)
from app.extract.dispatch import extract_file
from app.extract.types import ExtractionLimits
from app.config import LimitsConfig
extract_file("a.html", b"<html><body><p>Some text here.</p></body></html>", ExtractionLimits.of(LimitsConfig()), "a")
out["after_html"] = sorted(m for m in ("pypdf", "docx", "trafilatura") if m in sys.modules)
store.close()
print(json.dumps(out))
"""
    assert _run_python(code) == {"at_import": [], "read": True, "after_a_write_and_read": [],
                                 "after_html": ["trafilatura"]}


def test_ragblend_bounds_onednn_caches_unless_told_otherwise():
    code = "import json, os, app.cli; print(json.dumps({k: os.environ.get(k) for k in " \
           "('ONEDNN_PRIMITIVE_CACHE_CAPACITY', 'LRU_CACHE_CAPACITY')}))"
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHONPATH": str(REPO_ROOT)})
    assert json.loads(done.stdout) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}
    assert _run_python(code, {"LRU_CACHE_CAPACITY": "128"})["LRU_CACHE_CAPACITY"] == "128"
