"""The embedder in ONNX Runtime (`retrieval.embedder_runtime: onnx`, the default) against the same model
in torch: the same vectors for a question, a padded batch, a text past the model's length and other
scripts; its export (made by a child process, sentence-transformers never imported by the server) cached,
made again when damaged, kept when another process made it, refused for good when its check failed; a
cache directory that cannot be written, and the torch setting."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from configs.enums import EmbedderRuntime
from retrieval.config import RetrievalConfig
from retrieval.embedder import EXPORT_META, Embedder, export, resolve_model_path
from retrieval.retriever import Retriever

REPO_ROOT = Path(__file__).resolve().parents[1]

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


def test_the_setting_picks_the_runtime_and_onnx_caches_under_its_cache_dir(tmp_path):
    retriever = Retriever.open(tmp_path / "onnx", RetrievalConfig(embedder_cache_dir=tmp_path / "cache"))  # default
    try:
        assert retriever.embedder.runtime is EmbedderRuntime.ONNX
        assert len(list((tmp_path / "cache").glob("*/model.onnx"))) == 1
        assert not (tmp_path / "onnx" / "embedder").exists()  # a machine's cache, not a data directory's
    finally:
        retriever.close()
    retriever = Retriever.open(tmp_path / "torch", RetrievalConfig(embedder_runtime=EmbedderRuntime.TORCH,
                                                                   embedder_cache_dir=tmp_path / "unused"))
    try:
        assert retriever.embedder.runtime is EmbedderRuntime.TORCH
        assert not (tmp_path / "unused").exists()
    finally:
        retriever.close()


def test_onnx_never_imports_sentence_transformers_and_its_export_was_checked(tmp_path):
    """The point of exporting in a child: sentence-transformers and what it pulls in (scikit-learn, ~60-90
    MB resident) are never imported by the server, on the first start (exported now) or a later one."""
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from configs.enums import EmbedderRuntime\n"
        "from retrieval.embedder import Embedder\n"
        f"e = Embedder.from_name('all-minilm-l6-v2', runtime=EmbedderRuntime.ONNX, cache_dir=Path({str(tmp_path)!r}))\n"
        "v = e.encode_one('a question')\n"
        "print(json.dumps({'runtime': e.runtime.value, 'norm': float((v * v).sum()), "
        "'imported': sorted(m for m in ('sentence_transformers', 'sklearn') if m in sys.modules)}))\n")
    for _start in ("first", "cached"):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT,
                                check=False)
        assert result.returncode == 0, result.stderr[-2000:]
        out = json.loads(result.stdout.strip().splitlines()[-1])
        assert out["runtime"] == "onnx" and out["imported"] == [] and abs(out["norm"] - 1) < 1e-5
    [meta] = list(tmp_path.glob(f"*/{EXPORT_META}"))
    recorded = json.loads(meta.read_text())
    assert recorded["is_checked"] and recorded["dim"] == 384 and recorded["max_length"] == 256


def test_an_export_that_failed_its_check_runs_torch_and_is_not_made_again(tmp_path, caplog):
    Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.ONNX, cache_dir=tmp_path)
    [meta] = list(tmp_path.glob(f"*/{EXPORT_META}"))
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "is_checked": False, "check": "max 0.1"}))
    stamp = meta.stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="retrieval.embedder"):
        embedder = Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.ONNX, cache_dir=tmp_path)
    assert embedder.runtime is EmbedderRuntime.TORCH and "differs from sentence-transformers'" in caplog.text
    assert meta.stat().st_mtime_ns == stamp  # not exported again at every start


def test_a_whole_export_already_there_is_kept_unless_replacing(tmp_path):
    """Servers sharing the cache may export at once: the second to finish keeps the first's."""
    Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.ONNX, cache_dir=tmp_path)
    [meta] = list(tmp_path.glob(f"*/{EXPORT_META}"))
    stamp = meta.stat().st_mtime_ns
    model = resolve_model_path("all-minilm-l6-v2")
    export(model, meta.parent)
    assert meta.stat().st_mtime_ns == stamp
    export(model, meta.parent, is_replacing=True)
    assert meta.stat().st_mtime_ns != stamp and not list(tmp_path.glob("*.partial"))


def test_two_copies_of_a_model_get_exports_of_their_own(tmp_path):
    """The cache is a machine's: a fine-tune beside its base (the same names and sizes) must not be
    served the other's export."""
    import shutil

    source = resolve_model_path("all-minilm-l6-v2")
    copies = [shutil.copytree(source, tmp_path / side / "minilm") for side in ("a", "b")]
    made = [Embedder(Path(c), runtime=EmbedderRuntime.ONNX, cache_dir=tmp_path / "cache") for c in copies]
    assert all(e.runtime is EmbedderRuntime.ONNX for e in made) and made[0].identity == made[1].identity
    assert len(list((tmp_path / "cache").glob(f"*/{EXPORT_META}"))) == 2
