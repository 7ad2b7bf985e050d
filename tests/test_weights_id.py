"""The KV fingerprint covers the weights' content: a re-trained checkpoint of the same shape (same
file names and sizes) gets a new fingerprint, so its stale KV caches are never reused."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from blend_engine.config import BlendConfig
from blend_engine.engine import BlendEngine
from blend_engine.weights_id import weights_digest


def write_weights(directory, seed: int, mtime_ns: int = 1_700_000_000_000_000_000) -> None:
    torch.manual_seed(seed)
    path = directory / "model.safetensors"
    save_file({"a": torch.randn(256, 256), "b": torch.randn(1024)}, str(path))
    os.utime(path, ns=(mtime_ns, mtime_ns))  # same name, size and time: only the bytes differ


def test_same_shape_other_values_change_the_digest(tmp_path):
    write_weights(tmp_path, seed=0)
    first = weights_digest(tmp_path)
    assert first == weights_digest(tmp_path) and len(first) == 32
    size = (tmp_path / "model.safetensors").stat().st_size
    write_weights(tmp_path, seed=1)
    assert (tmp_path / "model.safetensors").stat().st_size == size
    assert weights_digest(tmp_path) != first
    write_weights(tmp_path, seed=0)
    assert weights_digest(tmp_path) == first
    write_weights(tmp_path, seed=0, mtime_ns=1_800_000_000_000_000_000)
    assert weights_digest(tmp_path) != first


def test_non_weight_files_and_missing_directories(tmp_path):
    write_weights(tmp_path, seed=0)
    first = weights_digest(tmp_path)
    (tmp_path / "README.md").write_text("notes")
    assert weights_digest(tmp_path) == first
    (tmp_path / "broken.safetensors").write_bytes(b"\x01")  # a damaged file still hashes, never raises
    assert weights_digest(tmp_path) not in ("", first)
    assert weights_digest(None) == "" and weights_digest(tmp_path / "nope") == ""


def test_the_engine_fingerprint_follows_the_checkpoint(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    fingerprints = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(tmp_path)
        weights = tmp_path / "model.safetensors"
        os.utime(weights, ns=(1_700_000_000_000_000_000,) * 2)
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
        fingerprints.append(BlendEngine.from_model(model, name="same-name", blend=BlendConfig.cacheblend()).fingerprint)
    assert fingerprints[0] != fingerprints[1]
