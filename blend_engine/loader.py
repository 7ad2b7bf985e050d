"""Model loading: a catalogue model by name (blend_engine/catalogue.py), any GGUF file (read natively:
blend_engine/gguf_loader.py), any local HF model directory, or a real architecture with random weights
(`random:<shape>`) for TTFT at size."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from blend_engine import cpu_gemm, native
from blend_engine.catalogue import CATALOGUE, verified
from blend_engine.config import ModelConfig
from blend_engine.embedding import Int8BlockEmbedding, compact_embedding
from blend_engine.gguf_loader import gguf_model_dir, load_gguf
from blend_engine.int4 import Int4Linear
from blend_engine.weights import Bf16Linear, Int8Linear, convert_linears, resolve_weight_format, weight_format
from blend_engine.weights_id import weights_digest
from configs.enums import WeightFormat

log = logging.getLogger(__name__)

EMBEDDED_MODEL = "smollm2"  # the catalogue model `make install` installs
# Real architectures' shapes (random weights): TTFT at production size where no weights can be had.
# Each keeps its real vocabulary; where the embedded tokenizer is installed, the vocabulary grows to
# cover it too (so real prompts can be fed), else the model has no tokenizer and callers feed ids.
RANDOM_SHAPES: dict[str, dict] = {
    "tiny-llama": dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
    ),
    "llama-7b": dict(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0,
    ),
    "mistral-7b": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1e6,
        sliding_window=None,
    ),
    "llama-3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
}


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object  # a transformers tokenizer
    identity: str  # what the weights are: part of the KV fingerprint
    is_random: bool = False  # random weights: quality figures are meaningless


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def embedded_gguf_path() -> Path:
    """The embedded SmolLM2's GGUF file, inside its package (`make install` installs it)."""
    model = CATALOGUE[EMBEDDED_MODEL]
    path = model.package_path()
    if path is None or not path.is_file():
        raise FileNotFoundError(f"the embedded model is not installed ({model.install_hint()})")
    return path


def resolve_model_path(name: str, cache_dir: Path) -> Path:
    """What `model.name` names: a catalogue model's file (installed and checked against its hash), a
    .gguf file or a model directory."""
    if name in CATALOGUE:
        model = CATALOGUE[name]
        path = model.path(cache_dir)
        if not path.is_file():
            raise FileNotFoundError(f"model {name!r} is not installed: {model.install_hint()}")
        verified(model, path, cache_dir)
        return path
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return path
    if path.is_dir():
        return path
    raise FileNotFoundError(f"model {name!r} is neither a catalogue model ({', '.join(CATALOGUE)}), a .gguf file, a "
                            "directory nor random:<shape>")


def load_model(settings: ModelConfig) -> LoadedModel:
    """The model with its linear layers in `settings.weights`' format (resolved for the device)."""
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    cpu_gemm.force(None if settings.gemm_dtype == "auto" else getattr(torch, settings.gemm_dtype))
    native.enable(settings.decode_kernel == "auto")  # read as quantized layers are made, as the GEMM dtype is
    if device.type == "cpu" and settings.weights != WeightFormat.FP32:
        # bf16 or fp32 prefill GEMMs: under auto measured once per machine and kept beside the models, so that
        # every start of this machine computes chunks' KV alike (blend_engine/cpu_gemm.py); read as the
        # quantized layers are made
        cpu_gemm.prefill_dtype(settings.cache_dir)
    if settings.name.startswith("random:"):
        loaded = _load_random(settings.name.removeprefix("random:"), settings.cache_dir, device, dtype,
                              settings.tokenizer)
        return _converted(loaded, settings.weights)
    path = resolve_model_path(settings.name, settings.cache_dir)
    if path.suffix == ".gguf":
        model, tokenizer = load_gguf(path, settings.cache_dir, settings.weights, device, dtype)
        loaded = LoadedModel(model, tokenizer, identity=f"{path.name}:{weights_digest(path)[:16]}")
        log.info("model %s: linear layers in %s weights, read from the file", loaded.identity,
                 weight_format(model).value)
        return loaded
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return _converted(LoadedModel(model, tokenizer, identity=f"{path.name}:{_dir_digest(path)}"), settings.weights)


def _converted(loaded: LoadedModel, weights: WeightFormat) -> LoadedModel:
    """`loaded` (as its checkpoint holds it) with its linear layers in `weights`' format."""
    fmt = resolve_weight_format(weights, loaded.model.device, loaded.model)
    num = convert_linears(loaded.model, fmt)
    if num and not loaded.is_random:  # loaded from a checkpoint, and most of it converted
        is_compact = compact_embedding(loaded.model)
        copied = own_remaining_weights(loaded.model)
        log.info("model %s: embedding %s; %d MB of other weights copied off the checkpoint's file mapping",
                 loaded.identity, "in int8 blocks (exact)" if is_compact else "as loaded", copied >> 20)
    log.info("model %s: %d linear layers in %s weights", loaded.identity, num, fmt.value)
    return loaded


def own_remaining_weights(model: torch.nn.Module) -> int:
    """Copy the parameters and buffers the conversion left as loaded (norms, the embedding where not
    compacted) into the process's own memory; returns their bytes.

    A safetensors checkpoint on CPU is loaded as views of a mapping of the whole file, and the
    conversion read every page of it: while one tensor still views the mapping, all of it stays in the
    process's memory (SmolLM2: 513 MB resident for a few MB still used). The converted layers are
    already copies, so with these copied too nothing holds the mapping and it is released."""
    made_here = (Int8Linear, Int4Linear, Bf16Linear, Int8BlockEmbedding)  # their own memory already
    copied_params: set[int] = set()
    copied_buffers: dict[int, torch.Tensor] = {}  # a buffer two modules share gets one copy
    num_bytes = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, made_here):
                continue
            for param in module.parameters(recurse=False):
                if param.device.type == "cpu" and id(param) not in copied_params:
                    copied_params.add(id(param))
                    num_bytes += param.nbytes
                    param.data = param.data.clone()  # the same Parameter (a tie stays), its own storage
            for name, buffer in module.named_buffers(recurse=False):
                if buffer.device.type != "cpu":
                    continue
                if id(buffer) not in copied_buffers:
                    num_bytes += buffer.nbytes
                    copied_buffers[id(buffer)] = buffer.clone()
                module._buffers[name] = copied_buffers[id(buffer)]  # persistent or not, as registered
    return num_bytes


def _load_random(spec: str, cache_dir: Path, device: torch.device, dtype: torch.dtype,
                 tokenizer_dir: Path | None = None) -> LoadedModel:
    """Random weights of a real architecture (seeded: the same weights on every load), built on `device`;
    its tokenizer `tokenizer_dir`'s where given, else the embedded one's where installed."""
    shape_name, _, layers = spec.partition(":")
    if shape_name not in RANDOM_SHAPES:
        raise ValueError(f"unknown random shape {shape_name!r}; one of {sorted(RANDOM_SHAPES)}")
    shape = dict(RANDOM_SHAPES[shape_name])
    if layers:
        shape["num_hidden_layers"] = int(layers)
    identity = f"random:{spec}:seed0"
    if tokenizer_dir is not None:
        if not tokenizer_dir.is_dir():
            raise FileNotFoundError(f"model.tokenizer: no directory {tokenizer_dir}")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        identity += f":tokenizer-{_dir_digest(tokenizer_dir)}"  # the vocabulary, so the weights, follow it
    else:
        tokenizer = _embedded_tokenizer(cache_dir)
    if tokenizer is not None:
        shape.update(vocab_size=max(shape["vocab_size"], len(tokenizer)), bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id)
    model_type = shape.pop("model_type")
    config = AutoConfig.for_model(model_type, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return LoadedModel(model, tokenizer, identity=identity, is_random=True)


def embedded_tokenizer_dir(cache_dir: Path) -> Path:
    """A directory holding the embedded SmolLM2's tokenizer and config (read from its GGUF once)."""
    return gguf_model_dir(embedded_gguf_path(), cache_dir)


def _embedded_tokenizer(cache_dir: Path):
    """The embedded SmolLM2 tokenizer, or None where its package is not installed (a bare GPU host)."""
    try:
        directory = embedded_tokenizer_dir(cache_dir)
    except FileNotFoundError:
        log.info("%s not installed: random-weight model without a tokenizer (feed token ids)", EMBEDDED_MODEL)
        return None
    return AutoTokenizer.from_pretrained(directory)


def _dir_digest(directory: Path) -> str:
    """Identity of a model directory's weights: names, sizes and mtimes of its files."""
    h = hashlib.sha256()
    for f in sorted(directory.glob("*")):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}".encode())
    return h.hexdigest()[:16]
