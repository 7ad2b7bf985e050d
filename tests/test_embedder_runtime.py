"""The embedder in ONNX Runtime (`retrieval.embedder_runtime: onnx`) against the same model in
torch: the same vectors for a question, a padded batch, a text past the model's length and other scripts;
its exported file cached and exported again when damaged; a cache directory that cannot be written, and
the torch setting."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from configs.enums import EmbedderRuntime
from retrieval.config import RetrievalConfig
from retrieval.embedder import Embedder
from retrieval.retriever import Retriever

TEXTS = [
    "What is the default compression level of gzip?",
    "x",
    "  leading and trailing spaces  ",
    "Größe, 漢字 and an emoji 😀 in one line",
    "a long text past the model's 256 tokens " * 60,  # truncated alike by both
    "Which file holds the OpenSSH server daemon's configuration?",
]


@pytest.fixture(scope="module")
def torch_embedder() -> Embedder:
    return Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.TORCH)


@pytest.fixture(scope="module")
def onnx_embedder(tmp_path_factory) -> Embedder:
    embedder = Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.ONNX,
                                  cache_dir=tmp_path_factory.mktemp("embedder"))
    assert embedder.runtime is EmbedderRuntime.ONNX
    return embedder


def test_onnx_gives_torchs_vectors_for_a_batch_and_for_one_text(torch_embedder, onnx_embedder):
    expected = torch_embedder.encode(TEXTS)  # [6, 384]
    batch = onnx_embedder.encode(TEXTS)  # padded to the longest: the mask's path
    assert batch.dtype == np.float32 and batch.shape == expected.shape
    assert np.abs(batch - expected).max() < 1e-5
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    for text, row in zip(TEXTS, expected):
        one = onnx_embedder.encode_one(text)
        assert one.shape == (onnx_embedder.dim,) and one.dtype == np.float32
        assert np.abs(one - row).max() < 1e-5
        assert np.abs(one - torch_embedder.encode_one(text)).max() < 1e-5
    assert onnx_embedder.identity == torch_embedder.identity  # the same space: no re-embedding on a switch


def test_a_batch_larger_than_batch_size_keeps_the_texts_order(torch_embedder, tmp_path):
    small_batches = Embedder.from_name("all-minilm-l6-v2", batch_size=2, runtime=EmbedderRuntime.ONNX,
                                       cache_dir=tmp_path)
    texts = TEXTS + [t.upper() for t in TEXTS]  # 12 texts of mixed lengths in 6 batches
    assert np.abs(small_batches.encode(texts) - torch_embedder.encode(texts)).max() < 1e-5
    assert small_batches.encode([]).shape == (0, small_batches.dim)


def test_the_export_is_cached_and_a_damaged_file_exported_again(tmp_path, caplog):
    first = Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.ONNX, cache_dir=tmp_path)
    [cached] = list(tmp_path.glob("*/model.onnx"))
    assert (cached.parent / "weights.bin").stat().st_size > 80e6  # the weights outside the graph: mapped
    stamp = cached.stat().st_mtime_ns
    second = Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.ONNX, cache_dir=tmp_path)
    assert second.runtime is EmbedderRuntime.ONNX and cached.stat().st_mtime_ns == stamp  # loaded, not exported
    assert not list(tmp_path.glob("*.partial"))
    cached.write_bytes(b"not an onnx graph")
    with caplog.at_level(logging.WARNING, logger="retrieval.embedder"):
        third = Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.ONNX, cache_dir=tmp_path)
    assert third.runtime is EmbedderRuntime.ONNX and "exporting it again" in caplog.text
    assert np.abs(third.encode_one(TEXTS[0]) - first.encode_one(TEXTS[0])).max() < 1e-6


def test_a_cache_directory_that_cannot_be_written_exports_to_a_temporary_file(tmp_path, caplog):
    blocked = tmp_path / "a file"
    blocked.write_text("in the way")
    with caplog.at_level(logging.WARNING, logger="retrieval.embedder"):
        embedder = Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.ONNX, cache_dir=blocked / "embedder")
    assert embedder.runtime is EmbedderRuntime.ONNX and "cannot write" in caplog.text
    assert embedder.encode_one("still answers").shape == (embedder.dim,)


def test_the_setting_picks_the_runtime_and_onnx_caches_under_the_data_directory(tmp_path):
    retriever = Retriever.open(tmp_path / "onnx", RetrievalConfig(embedder_runtime=EmbedderRuntime.ONNX))
    try:
        assert retriever.embedder.runtime is EmbedderRuntime.ONNX
        assert len(list((tmp_path / "onnx" / "embedder").glob("*/model.onnx"))) == 1
    finally:
        retriever.close()
    retriever = Retriever.open(tmp_path / "torch", RetrievalConfig())  # the default: memory (docs/decisions/0024)
    try:
        assert retriever.embedder.runtime is EmbedderRuntime.TORCH
        assert not (tmp_path / "torch" / "embedder").exists()
    finally:
        retriever.close()
