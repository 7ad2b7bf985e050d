"""Tiny GGUF files written for the tests: a llama, qwen2 or qwen3 of random weights, each tensor in a chosen
ggml type, with the embedded SmolLM2's tokenizer (the one GGUF tokenizer installed everywhere)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf.quants import quantize

from blend_engine.loader import embedded_gguf_path

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # K-quants need rows of 256 values
VOCAB = 49152  # the SmolLM2 tokenizer's

# each projection in another type, so one file covers every type the loader decodes itself
MIXED_TYPES = {"attn_q": QT.Q4_K, "attn_k": QT.Q4_0, "attn_v": QT.Q6_K, "attn_output": QT.Q5_0,
               "ffn_gate": QT.Q4_1, "ffn_up": QT.Q8_0, "ffn_down": QT.F16}


@dataclass(frozen=True)
class TokenizerFields:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos: int
    eos: int
    chat_template: str


@lru_cache(maxsize=1)
def smollm2_tokenizer() -> TokenizerFields:
    reader = GGUFReader(embedded_gguf_path())
    value = lambda key: reader.fields[key].contents()  # noqa: E731
    return TokenizerFields(value("tokenizer.ggml.tokens"), value("tokenizer.ggml.token_type"),
                           value("tokenizer.ggml.merges"), value("tokenizer.ggml.bos_token_id"),
                           value("tokenizer.ggml.eos_token_id"), value("tokenizer.chat_template"))


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] uint8: `qtype` blocks of random weights of a plausible scale (~0.05)."""
    if qtype in (QT.F32, QT.F16):
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32 if qtype == QT.F32 else np.float16)
        return values.view(np.uint8).reshape(rows, -1)
    if qtype not in (QT.Q4_K, QT.Q6_K):  # gguf-py quantizes these itself
        return quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype).reshape(rows, -1)
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    if qtype == QT.Q4_K:  # d, dmin fp16 first: the rest (6-bit scales and mins, nibbles) any bytes
        data[:, 0:2] = np.full((len(data), 1), 2e-4, np.float16).view(np.uint8)
        data[:, 2:4] = np.full((len(data), 1), 1e-3, np.float16).view(np.uint8)
    else:  # Q6_K: int8 scales at 192..207, d fp16 last
        data[:, 192:208] = rng.integers(-20, 20, (len(data), 16), dtype=np.int8).view(np.uint8)
        data[:, 208:210] = np.full((len(data), 1), 2e-4, np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def write_gguf(path: Path, architecture: str = "qwen2", types: dict[str, QT] | None = None,
               embedding: QT = QT.Q8_0, output: QT | None = QT.Q6_K, seed: int = 0) -> Path:
    """A tiny model of `architecture` with random weights: projections in `types` (MIXED_TYPES by default),
    the embedding in `embedding`, an lm_head of its own in `output` (None: tied to the embedding)."""
    types = MIXED_TYPES if types is None else types
    rng = np.random.default_rng(seed)
    tokenizer = smollm2_tokenizer()
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(1e6 if architecture != "llama" else 1e4)
    writer.add_layer_norm_rms_eps(1e-6)
    if architecture == "qwen3":
        writer.add_key_length(HIDDEN // HEADS)
        writer.add_value_length(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokenizer.tokens)
    writer.add_token_types(tokenizer.token_types)
    writer.add_token_merges(tokenizer.merges)
    writer.add_bos_token_id(tokenizer.bos)
    writer.add_eos_token_id(tokenizer.eos)
    writer.add_chat_template(tokenizer.chat_template)

    def tensor(name: str, qtype: QT, rows: int, cols: int | None = None) -> None:
        if cols is None:  # a vector (norms, biases): F32
            writer.add_tensor(name, (rng.standard_normal(rows) * 0.1 + (1.0 if "norm" in name else 0.0)).astype(
                np.float32))
            return
        data = random_blocks(qtype, rows, cols, rng)  # bytes [rows, row_bytes]: the writer infers the shape
        if qtype in (QT.F32, QT.F16):
            writer.add_tensor(name, data.view(np.float32 if qtype == QT.F32 else np.float16))
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", embedding, VOCAB, HIDDEN)
    tensor("output_norm.weight", QT.F32, HIDDEN)
    if output is not None:
        tensor("output.weight", output, VOCAB, HIDDEN)
    for i in range(LAYERS):
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
                  "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
                  "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
        tensor(f"blk.{i}.attn_norm.weight", QT.F32, HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", QT.F32, HIDDEN)
        for part, (rows, cols) in shapes.items():
            tensor(f"blk.{i}.{part}.weight", types[part], rows, cols)
        if architecture == "qwen2":
            for part in ("attn_q", "attn_k", "attn_v"):
                tensor(f"blk.{i}.{part}.bias", QT.F32, shapes[part][0])
        if architecture == "qwen3":
            tensor(f"blk.{i}.attn_q_norm.weight", QT.F32, head_dim)
            tensor(f"blk.{i}.attn_k_norm.weight", QT.F32, head_dim)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
