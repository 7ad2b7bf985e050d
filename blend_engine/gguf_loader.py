"""A GGUF file loaded natively: its tensors straight into the engine's weight formats, tensor by tensor.

transformers' own GGUF path dequantizes the whole model to fp32 (Qwen2.5-1.5B: 7 GB in memory, 131-139 s
through the safetensors copy the engine used to make). Here each tensor is read from the file, decoded
(blend_engine/gguf_quants.py) and packed into the module the engine multiplies by, so no fp32 copy of more
than one tensor exists at a time:

- a 4-bit tensor (Q4_0, Q4_1, Q4_K: 16 levels in blocks of 32) goes into the int4 kernel level for level,
  its block's scale and offset rounded to bf16 (`Int4Linear.from_levels`); any other type (Q5_0, Q6_K,
  Q8_0, F16, ...) into int8 per output channel. That mix is the `gguf` weight format, what `auto` means
  for a GGUF on CPU; int4, int8, bf16 or fp32 convert every layer to that format instead.
- the token embedding stays in the file's blocks, as int8 levels with their scales (exact:
  blend_engine/embedding.py); the lm_head (the file's `output`, or the embedding where tied) in int8.
- everything else (norms, biases, Qwen3's q/k norms) in the model's dtype.

The model skeleton is transformers' own class for the architecture, built with empty weights and filled
here; llama files store q and k with their rows interleaved per head (llama.cpp's rope layout) and are
put back in transformers' order. The config, the tokenizer (with its chat template) and the table of
tensors are read from the file once and kept in `model.cache_dir` (`gguf_model_dir`): a warm start reads
only the weights. A file that cannot be served (an architecture the engine does not run, a tensor type it
does not read, a truncated file) is refused with its reason before anything is allocated.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from blend_engine.embedding import Int8BlockEmbedding
from blend_engine.gguf_quants import (BLOCK_TYPES, INT4_TYPES, SUPPORTED_TYPES, Blocks, decode_blocks, dequantize,
                                      row_bytes, type_name)
from blend_engine.int4 import Int4Linear
from blend_engine.weights import Bf16Linear, Int8Linear, fuse_block, quantize_int8
from configs.enums import WeightFormat

log = logging.getLogger(__name__)

# general.architecture -> gguf-py's tensor-name map; the families the engine's runner computes
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_TABLE = "tensors.json"
_MARKER = ".ragblend-complete"
_SLICE_BYTES = 4 << 20  # fp32 bytes of a matrix dequantized at a time when it becomes int8 (`_int8_rows`)


class GGUFError(ValueError):
    """A GGUF file that cannot be served, and why."""


@dataclass(frozen=True)
class TensorEntry:
    qtype: int  # ggml's type number
    shape: tuple[int, ...]  # torch's order: [rows, cols] for a matrix (ggml lists it the other way round)
    offset: int  # bytes from the start of the file
    num_bytes: int


class GGUFTensors:
    """A GGUF file's tensors by name, each read from the file when decoded (not mapped: pages of a mapping
    read once would stay in the process's memory until it is closed)."""

    def __init__(self, path: Path, architecture: str, entries: dict[str, TensorEntry], head_dim: int | None = None):
        self.path, self.architecture, self.entries = path, architecture, entries
        self.head_dim = head_dim  # the file's attention.key_length, where it states one

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def entry(self, name: str) -> TensorEntry:
        if name not in self.entries:
            raise GGUFError(f"{self.path.name} has no tensor {name!r}: not a complete {self.architecture} model")
        return self.entries[name]

    def raw(self, name: str, rows: slice = slice(None)) -> np.ndarray:
        """The tensor's bytes, [r, row_bytes] uint8, for `rows` (all by default)."""
        entry = self.entry(name)
        width = row_bytes(entry.qtype, entry.shape[-1])
        start, stop, _ = rows.indices(entry.num_bytes // width)
        data = np.fromfile(self.path, dtype=np.uint8, count=(stop - start) * width, offset=entry.offset + start * width)
        return data.reshape(stop - start, width)

    def blocks(self, name: str) -> Blocks:
        entry = self.entry(name)
        return decode_blocks(self.raw(name), entry.qtype, entry.shape[-1])

    def dequantized(self, name: str, rows: slice = slice(None)) -> torch.Tensor:
        """[r, cols] fp32 (a vector as [1, n])."""
        entry = self.entry(name)
        return dequantize(self.raw(name, rows), entry.qtype, entry.shape[-1])


def read_header(path: Path) -> GGUFTensors:
    """The file's architecture and tensor table, checked: every reason not to serve it is raised here,
    before a weight is read (see `_parsed_header`)."""
    return _parsed_header(path)[1]


def _parsed_header(path: Path) -> tuple[dict[str, object], GGUFTensors]:
    """(the file's metadata, its checked tensor table), from one walk of the header by transformers' header
    reader (integrations/gguf/reader.py), which skips the vocabulary's strings: ~0.04 s for a 152k-token
    file, where gguf-py's GGUFReader takes ~7 s. Its table, not its `GgufHeader`: that one refuses the types
    transformers does not decode (Q5_0, Q5_1), which ragblend reads."""
    from gguf import GGML_QUANT_SIZES
    from transformers.integrations.gguf import reader

    try:
        blob = reader._mapped(str(path))
        metadata, num_tensors, pos = reader._read_metadata(blob, str(path))
        table, pos = reader._read_tensor_table(blob, num_tensors, pos)
    except Exception as exc:  # the reader's errors name no file; a truncated header fails in struct or numpy
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from exc
    architecture = str(metadata.get("general.architecture", "(none)"))
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path.name}: architecture {architecture!r} is not supported; ragblend runs GGUF files of "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    alignment = int(metadata.get("general.alignment", 32))  # llama.cpp's default
    data_start = (pos + alignment - 1) // alignment * alignment  # the data section: aligned after the table
    entries: dict[str, TensorEntry] = {}
    for name, shape, qtype, offset in table:  # shape in torch's order
        if qtype not in SUPPORTED_TYPES:
            raise GGUFError(f"{path.name}: tensor {name} is {type_name(qtype)}, which ragblend does "
                            f"not read; supported: {', '.join(sorted(type_name(t) for t in SUPPORTED_TYPES))}")
        block_size, block_bytes = GGML_QUANT_SIZES[QT(qtype)]
        entries[name] = TensorEntry(int(qtype), tuple(int(n) for n in shape), data_start + int(offset),
                                    int(np.prod(shape)) // block_size * block_bytes)
    check_complete(path, entries)
    key_length = metadata.get(f"{architecture}.attention.key_length")
    return metadata, GGUFTensors(path, architecture, entries, None if key_length is None else int(key_length))


def config_dict(metadata: dict[str, object], tensor_names: Iterable[str]) -> dict[str, object]:
    """The transformers config of a llama, qwen2 or qwen3 file, from metadata read by transformers' fast reader
    (string arrays as their lengths), mapped by transformers' own table (GGUF_CONFIG_MAPPING) as its legacy
    reader maps them: that reader builds gguf-py's whole GGUFReader, ~8 s for a 152k-token vocabulary, and
    AutoConfig/AutoTokenizer each run it for these architectures."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = str(metadata["general.architecture"])
    config: dict[str, object] = {"tie_word_embeddings": "output.weight" not in set(tensor_names)}
    config.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}))
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target is None or target == -1:
            continue
        config[target] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = int(metadata["tokenizer.ggml.tokens"])  # the reader's count of the array
    return config


def check_complete(path: Path, entries: dict[str, TensorEntry]) -> None:
    size = path.stat().st_size
    end = max((e.offset + e.num_bytes for e in entries.values()), default=0)
    if end > size:
        raise GGUFError(f"{path} is truncated: {size} bytes where its tensors end at byte {end}")


def gguf_model_dir(path: Path, cache_dir: Path) -> Path:
    """A directory holding `path`'s config.json, tokenizer (with its chat template) and tensor table, read
    from the file once (~1.5 s for a 152k-token vocabulary, the tokenizer's build most of it) and kept for
    warm starts. No weights: those are read from the file at every load. Keyed by the file's path, size and
    mtime."""
    stat = path.stat()
    digest = hashlib.sha256(f"gguf:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / f"{path.stem}-{digest}"
    if (target / _MARKER).exists():
        return target
    metadata, header = _parsed_header(path)  # refuses the file before anything is built
    from transformers import AutoConfig
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    log.info("reading %s's config and tokenizer into %s (first load only)", path, target)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".gguf-"))
    try:
        config = AutoConfig.for_model(**config_dict(metadata, header.entries))
        if header.head_dim is not None and hasattr(config, "head_dim"):
            config.head_dim = header.head_dim  # transformers maps no key_length: Qwen3's head_dim is not hidden / heads
        config.save_pretrained(tmp)
        # the class AutoTokenizer picks for this model type, built by its own GGUF path (the fast reader);
        # AutoTokenizer itself would first rebuild the config through the legacy reader
        class_name = TOKENIZER_MAPPING_NAMES.get(config.model_type)
        tokenizer_class = tokenizer_class_from_name(class_name) if class_name else TokenizersBackend
        tokenizer_class.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        table = {name: [e.qtype, list(e.shape), e.offset, e.num_bytes] for name, e in header.entries.items()}
        (tmp / _TABLE).write_text(json.dumps({"architecture": header.architecture, "tensors": table}))
        (tmp / _MARKER).touch()
        try:
            os.rename(tmp, target)  # atomic: a concurrent loader's copy is just as good
        except OSError:
            if not (target / _MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def cached_tensors(path: Path, model_dir: Path) -> GGUFTensors:
    table = json.loads((model_dir / _TABLE).read_text())
    entries = {name: TensorEntry(qtype, tuple(shape), offset, num_bytes)
               for name, (qtype, shape, offset, num_bytes) in table["tensors"].items()}
    check_complete(path, entries)  # the file may have been cut since its table was read
    return GGUFTensors(path, table["architecture"], entries)


def resolve_gguf_format(fmt: WeightFormat, device: torch.device) -> WeightFormat:
    """auto: each layer as its type is stored (`gguf`) on CPU, the dequantized weights elsewhere."""
    if fmt == WeightFormat.AUTO:
        return WeightFormat.GGUF if device.type == "cpu" else WeightFormat.FP32
    if fmt in (WeightFormat.GGUF, WeightFormat.INT4) and device.type != "cpu":
        raise ValueError(f"model.weights {fmt.value} runs on CPU only (its kernels are torch's CPU int4/int8 matmuls)")
    return fmt


def load_gguf(path: Path, cache_dir: Path, fmt: WeightFormat, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) of a GGUF file, its layers in `fmt` (resolved: see `resolve_gguf_format`)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = gguf_model_dir(path, cache_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, RoPE's tables real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    fmt = resolve_gguf_format(fmt, device)
    packed = model_dir / f"packed-{fmt.value}-{_packing_key()}.pt"
    is_kept = fmt in (WeightFormat.GGUF, WeightFormat.INT4, WeightFormat.INT8) and dtype == torch.float32
    if not (is_kept and _restore(model, packed)):
        _fill(model, cached_tensors(path, model_dir), fmt, dtype)
        for block in model.get_decoder().layers:
            fuse_block(block)  # the parts the engine fuses, joined now: kept so, they map in as views of one buffer
        if is_kept:
            _keep(model, packed)
    if is_kept:
        _prune_stale(model_dir)
    if hasattr(model.config, "tie_word_embeddings"):
        model.config.tie_word_embeddings = False  # the lm_head is a module of its own now: nothing re-ties it
    model.name_or_path = str(path)  # the KV fingerprint digests the file (blend_engine/weights_id.py)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model.to(device).eval(), tokenizer


# ---- the packed modules kept for warm starts -------------------------------------------------------------
# Decoding and packing Qwen2.5-1.5B's 1.3 billion weights (the int4 kernel's layout, prefill's bf16 copies)
# takes ~9 s on 2 cores, writing them ~8 s; reading them back ~1-2 s. They are kept beside the config (3.6 GB
# for that model), keyed by the weight format, torch's version, the CPU's vector ISA and the layout of the
# int4 levels (blocks of 8 rows of nibbles since stop 71, their scales by blocks too since stop 74:
# blend_engine/int4.py; the parts the engine fuses joined since stop 77: blend_engine/rows.py; files of a
# layout before are not read, and deleted once unread for two weeks). A start maps the file (`_restore`).


STALE_AFTER_S = 14 * 24 * 3600.0  # a kept file no start has used for two weeks: an older release's layout


def _prune_stale(model_dir: Path) -> list[Path]:
    """Delete the packed files in `model_dir` that no start has used for `STALE_AFTER_S`, and the partial
    copies of a writer that died (writing one takes seconds); returns what was deleted. Each change of the
    packing key (torch, the CPU, the int4 layout) leaves the previous file behind, 3.6 GB for the 1.5B. A
    start marks the file it reads as used (`_restore`), so a release that still runs beside this one keeps its
    own. A file that cannot be deleted (a read-only cache) stays, logged."""
    now = time.time()
    deleted = []
    for pattern, max_age_s in (("packed-*.pt", STALE_AFTER_S), (".packed-*.pt.*", 3600.0)):
        for path in model_dir.glob(pattern):
            try:
                if now - path.stat().st_mtime > max_age_s:
                    path.unlink()
                    deleted.append(path)
            except FileNotFoundError:  # another process starting beside this one deleted it first
                continue
            except OSError as exc:
                log.warning("could not delete the unused packed weights %s (%s)", path, exc)
    if deleted:
        log.info("deleted %d packed weight files, unread for %.0f days or a dead writer's: %s", len(deleted),
                 STALE_AFTER_S / 86400, ", ".join(p.name for p in deleted))
    return deleted


def _packing_key() -> str:
    key = f"{torch.__version__}:{torch.backends.cpu.get_cpu_capability()}:int4-nibble-blocks-of-8:block-scales:joined"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _keep(model: nn.Module, target: Path) -> None:
    """Every tensor of `model`'s modules and which class holds it, into `target` (atomically). A disk that
    cannot hold it costs the next start its speed, nothing else: logged, not raised."""
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, (Int4Linear, Int8Linear, Int8BlockEmbedding)):
            kinds[name] = type(module).__name__
            if isinstance(module, Int8Linear) and module.is_copy_kept:
                kinds[name] += ":kept"
            held = dict(module.named_buffers(recurse=False)) | dict(module.named_parameters(recurse=False))
            if isinstance(module, Int8Linear):
                held.pop("gemm_weight", None)  # made from the levels where this machine's GEMMs want it
            tensors.update({f"{name}.{key}": value for key, value in held.items() if value is not None})
    owned = {id(t) for t in tensors.values()}
    for name, param in model.named_parameters():
        if name not in tensors and id(param) not in owned:
            tensors[name] = param.detach()
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        torch.save({"kinds": json.dumps(kinds), "tensors": tensors}, tmp)
        os.replace(tmp, target)
    except (OSError, RuntimeError) as exc:  # torch's zip writer raises RuntimeError on a full disk
        log.warning("could not keep the packed weights in %s (%s): the next start packs them again", target, exc)
        tmp.unlink(missing_ok=True)


def _restore(model: nn.Module, source: Path) -> bool:
    """`model` (on the meta device) filled from a `_keep` file; False (the model untouched) where there is none,
    or it cannot be read (removed then, so that this start packs the file again and keeps a good copy)."""
    if not source.is_file():
        return False
    try:
        # mapped, not read: the weights stay pages of the file (shared by every process that maps it, nothing
        # copied at start). The parts the engine fuses were kept joined (`load_gguf`), so fusing them again
        # views the mapping too, where a copy would leave the mapped pages it read in the process beside it.
        kept = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        kinds: dict[str, str] = json.loads(kept["kinds"])
        tensors: dict[str, torch.Tensor] = kept["tensors"]
    except Exception as exc:  # a damaged file fails in torch's zip reader, in pickle or in json
        log.warning("the packed weights in %s cannot be read (%s): packing the GGUF again", source, exc)
        source.unlink(missing_ok=True)
        return False
    try:
        os.utime(source)  # used now: `_prune_stale` keeps it
    except OSError:  # a read-only cache: nothing is pruned there either
        pass
    for name, kind in kinds.items():
        part = lambda key: tensors.get(f"{name}.{key}")  # noqa: E731
        if kind == "Int4Linear":
            module = Int4Linear(part("nibbles"), part("block_scales"), part("gemm_weight"), part("bias"))
        elif kind.startswith("Int8Linear"):
            module = Int8Linear(part("qweight"), part("scales"), part("bias"), is_copy_kept=kind.endswith(":kept"))
        else:
            module = Int8BlockEmbedding(part("qweight"), part("scales"), part("offsets"))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
    for name, param in list(model.named_parameters()):
        if param.device.type == "meta":
            parent, _, leaf = name.rpartition(".")
            model.get_submodule(parent)._parameters[leaf] = nn.Parameter(tensors[name], requires_grad=False)
    return True


def _fill(model: nn.Module, tensors: GGUFTensors, fmt: WeightFormat, dtype: torch.dtype) -> None:
    """Every parameter of `model` (built on the meta device) from `tensors`."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    config = model.config
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == tensors.architecture)
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    # llama.cpp writes a llama's q and k rows interleaved per head (its rope layout); the heads to undo it by
    interleaved = ({"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
                   if tensors.architecture == "llama" else {})

    def gguf_name(module_name: str) -> str:
        name = names.get_name(module_name)
        if name is None:
            raise GGUFError(f"no GGUF tensor maps to {module_name} of {type(model).__name__}")
        return name

    with torch.no_grad():
        for module_name, module in list(model.get_decoder().layers.named_modules(prefix="model.layers")):
            if isinstance(module, nn.Linear):
                name = gguf_name(module_name)
                heads = interleaved.get(name.rsplit(".", 1)[-1])
                parent, _, child = module_name.rpartition(".")
                setattr(model.get_submodule(parent), child, _linear(tensors, name, module, fmt, dtype, heads))
        embedding = model.get_input_embeddings()
        embed_name = gguf_name("model.embed_tokens")
        head_name = "output" if "output.weight" in tensors else embed_name  # tied: the embedding read again
        if fmt in (WeightFormat.FP32, WeightFormat.BF16):
            weight = tensors.dequantized(f"{embed_name}.weight").to(dtype)
            model.set_input_embeddings(nn.Embedding.from_pretrained(weight, freeze=True))
            lm_weight = weight if head_name == embed_name else tensors.dequantized("output.weight").to(dtype)
            head = nn.Linear(lm_weight.shape[1], lm_weight.shape[0], bias=False, device="cpu", dtype=dtype)
            head.weight = nn.Parameter(lm_weight, requires_grad=False)  # a tie stays one matrix
            model.set_output_embeddings(head if fmt == WeightFormat.FP32 else Bf16Linear(lm_weight, None))
        else:
            model.set_input_embeddings(_embedding(tensors, f"{embed_name}.weight", embedding.embedding_dim))
            model.set_output_embeddings(_int8_rows(tensors, f"{head_name}.weight", is_copy_kept=False))
        for module_name, module in model.named_modules():
            for leaf, param in list(module.named_parameters(recurse=False)):
                if param.device.type != "meta":
                    continue
                name = f"{gguf_name(module_name)}.{leaf}"
                value = tensors.dequantized(name).reshape(param.shape).to(dtype)
                module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def _unleave(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [n, ...] of a llama q or k put back in transformers' order: llama.cpp stores each head's rows
    as (pairs, 2), transformers as (2, pairs) (transformers' LlamaTensorProcessor undoes it the same way)."""
    return t.reshape(num_heads, t.shape[0] // num_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _linear(tensors: GGUFTensors, name: str, module: nn.Linear, fmt: WeightFormat, dtype: torch.dtype,
            heads: int | None) -> nn.Module:
    entry = tensors.entry(f"{name}.weight")
    if entry.shape != (module.out_features, module.in_features):
        raise GGUFError(f"{tensors.path.name}: {name}.weight is {list(entry.shape)}, the config's layer "
                        f"{module.out_features}x{module.in_features}")
    bias = tensors.dequantized(f"{name}.bias").reshape(-1) if module.bias is not None else None
    order = (lambda t: _unleave(t, heads)) if heads else (lambda t: t)  # noqa: E731
    if bias is not None:
        bias = order(bias)
    is_int4 = Int4Linear.fits(*entry.shape)
    if fmt in (WeightFormat.GGUF, WeightFormat.INT4) and is_int4 and entry.qtype in INT4_TYPES:
        blocks = tensors.blocks(f"{name}.weight")
        # stored value = level * scale + offset; the kernel's = (q - 8) * scale + zero with q in 0..15
        shift = 8 if entry.qtype == QT.Q4_0 else 0  # Q4_0's levels are -8..7, Q4_1's and Q4_K's 0..15
        offsets = blocks.offsets if blocks.offsets is not None else torch.zeros_like(blocks.scales)
        zero = offsets + (8 - shift) * blocks.scales
        return Int4Linear.from_levels(order(blocks.levels + shift if shift else blocks.levels), order(blocks.scales),
                                      order(zero), bias)
    if fmt in (WeightFormat.GGUF, WeightFormat.INT8) or (fmt == WeightFormat.INT4 and not is_int4):
        return _int8_rows(tensors, f"{name}.weight", bias, heads)
    weight = order(tensors.dequantized(f"{name}.weight"))
    if fmt == WeightFormat.INT4:
        return Int4Linear.from_weight(weight, bias)
    if fmt == WeightFormat.BF16:
        return Bf16Linear(weight, bias)
    linear = nn.Linear(module.in_features, module.out_features, bias=bias is not None, device="cpu", dtype=dtype)
    linear.weight.copy_(weight)
    if bias is not None:
        linear.bias.copy_(bias)
    return linear.requires_grad_(False)


def _embedding(tensors: GGUFTensors, name: str, dim: int) -> nn.Module:
    """The token embedding in the file's own blocks (exact), or dense where its type has none (F16, ...)."""
    entry = tensors.entry(name)
    if entry.qtype in BLOCK_TYPES:
        blocks = tensors.blocks(name)
        return Int8BlockEmbedding(blocks.levels, blocks.scales, blocks.offsets)
    return nn.Embedding.from_pretrained(tensors.dequantized(name).reshape(-1, dim), freeze=True)


def _int8_rows(tensors: GGUFTensors, name: str, bias: torch.Tensor | None = None, heads: int | None = None,
               is_copy_kept: bool = True) -> Int8Linear:
    """An Int8Linear from `name`, dequantized and quantized a slice of rows at a time: the fp32 of a slice
    (~4 MB) is reused from one slice to the next where a whole matrix's is fresh pages (a 152k-token lm_head's
    would be ~1 GB). A llama's q or k (`heads`) has its rows put back in transformers' order after: int8 is
    per row, so reordering the levels and scales is reordering the weight. The lm_head's prefill copy is made
    only once it sees many rows (`is_copy_kept`; see Int8Linear)."""
    num_rows, num_cols = tensors.entry(name).shape
    step = max(1, _SLICE_BYTES // (4 * num_cols))  # rows a slice
    levels = torch.empty(num_rows, num_cols, dtype=torch.int8)
    scales = torch.empty(num_rows, dtype=torch.bfloat16)
    for start in range(0, num_rows, step):
        rows = slice(start, start + step)
        levels[rows], scales[rows] = quantize_int8(tensors.dequantized(name, rows))
    if heads:
        levels, scales = _unleave(levels, heads), _unleave(scales, heads)
    return Int8Linear(levels, scales, bias, is_copy_kept)
