"""The identity of an engine's KV (`engine_fingerprint`), and a content identity of a model
directory's weights, cheap on multi-GB files (`weights_digest`).

File names and sizes alone miss a re-trained checkpoint of the same shape (its KV caches would be
reused though stale). Per weight file this hashes its name, size and mtime, its safetensors header
(tensor names, dtypes, shapes, offsets, metadata) and a sample of its bytes: NUM_SAMPLES blocks
spread evenly over the file, about 1 MiB read whatever its size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

# Bump when what a ChunkKV means changes (pre-RoPE keys, sink handling): old caches then miss.
KV_FORMAT_VERSION = 1

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
NUM_SAMPLES = 16
SAMPLE_BYTES = 64 << 10
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def weights_digest(location: str | Path | None) -> str:
    """Hex digest of the weight files in directory `location`, or of weight file `location` (a GGUF); ''
    when it is neither (random weights)."""
    if not location:
        return ""
    location = Path(location)
    if location.is_file() and location.suffix in WEIGHT_SUFFIXES:
        return hashlib.sha256(_file_digest(location)).hexdigest()[:32]
    if not location.is_dir():
        return ""
    h = hashlib.sha256()
    for path in sorted(location.iterdir()):
        if path.is_file() and path.suffix in WEIGHT_SUFFIXES:
            h.update(_file_digest(path))
    return h.hexdigest()[:32]


def _file_digest(path: Path) -> bytes:
    stat = path.stat()
    h = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    with path.open("rb") as f:
        if path.suffix == ".safetensors":
            h.update(_safetensors_header(f, stat.st_size))
        step = max(stat.st_size // NUM_SAMPLES, 1)
        for offset in range(0, stat.st_size, step)[:NUM_SAMPLES]:
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
    return h.digest()


def _safetensors_header(f, size: int) -> bytes:
    """The JSON header (8-byte little-endian length, then the JSON); a damaged one hashes as read."""
    head = f.read(8)
    if len(head) < 8:
        return head
    (length,) = struct.unpack("<Q", head)
    return f.read(min(length, MAX_HEADER_BYTES, max(size - 8, 0)))


def engine_fingerprint(engine) -> str:
    """Everything a stored ChunkKV depends on: entries of two models or formats never mix."""
    config = engine.model.config
    tokenizer_id = ""
    if engine.tokenizer is not None:
        vocab = sorted(engine.tokenizer.get_vocab().items())
        tokenizer_id = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()
    parts = {
        "model": engine.model_name,
        "weights": weights_digest(getattr(engine.model, "name_or_path", None)),  # content, not just names
        "dtype": str(engine.dtype),
        "layers": engine.num_layers,
        "heads": config.num_attention_heads,
        "kv_heads": engine.num_kv_heads,
        "head_dim": engine.head_dim,
        "rope": getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None),
        "rope_theta": getattr(config, "rope_theta", None),
        "tokenizer": tokenizer_id,
        "format": KV_FORMAT_VERSION,
        "weight_format": engine.weights.value,  # int8 weights make other KV than fp32 ones
    }
    if engine.attention_dtype != engine.dtype:  # only then: the KV of an unchanged config keeps its key
        # and from which length on (BF16_MIN_KEYS under auto): a chunk between two thresholds differs
        parts["attention"] = f"{engine.attention_dtype} from {engine.min_cast_keys} keys"
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
