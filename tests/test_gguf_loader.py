"""GGUF files read natively (blend_engine/gguf_loader.py): each type decoded as gguf-py does, a model equal to
transformers' reading of the same file, each layer in the kernel nearest its type, a full prefill equal to a
reference forward on the same weights, and every reason to refuse a file said before anything is made."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from torch import nn
from transformers import AutoModelForCausalLM

from blend_engine import catalogue, cpu_gemm, int4, weights
from blend_engine.catalogue import CATALOGUE, verified
from blend_engine.config import ModelConfig
from blend_engine.embedding import Int8BlockEmbedding
from blend_engine.engine import BlendEngine
from blend_engine.gguf_loader import GGUFError, cached_tensors, gguf_model_dir, read_header
from blend_engine.gguf_quants import dequantize
from blend_engine.int4 import Int4Linear
from blend_engine.loader import load_model
from blend_engine.types import PrefillMode, Segment
from blend_engine.weights import Int8Linear, weight_format
from configs.enums import WeightFormat
from tests.gguf_files import MIXED_TYPES, random_blocks, write_gguf

pytestmark = pytest.mark.smollm2  # the test files carry the embedded SmolLM2's tokenizer

PROMPT = list(range(1000, 1064))  # 64 tokens: prefill's GEMM path (over 32 rows), not decode's packed kernels


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("gguf")
    return {
        "llama": write_gguf(directory / "tiny-llama.gguf", "llama", output=None),  # tied, as SmolLM2
        "qwen2": write_gguf(directory / "tiny-qwen2.gguf", "qwen2"),  # q/k/v biases, an lm_head of its own
        "qwen3": write_gguf(directory / "tiny-qwen3.gguf", "qwen3"),  # q/k norms
    }


@pytest.fixture(autouse=True)
def gemm_auto_after():
    """These tests force fp32 prefill GEMMs (exact comparisons); the process's choice is auto again after."""
    yield
    cpu_gemm.force(None)


def settings(path: Path, cache_dir: Path, **changes) -> ModelConfig:
    return ModelConfig(name=str(path), cache_dir=cache_dir, device="cpu", gemm_dtype="float32", **changes)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.F16])
def test_each_type_decodes_bit_for_bit_as_gguf_py(qtype):
    raw = random_blocks(qtype, 8, 512, np.random.default_rng(1))
    ours = dequantize(raw, qtype, 512)
    theirs = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, qtype))).reshape(8, 512).float()
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_file_loads_as_transformers_reads_it(arch, files, tmp_path):
    """Dequantized to fp32, the native model is transformers' reading of the file, logit for logit: the
    names, llama's interleaved q/k rows, the biases, a tied or separate lm_head all mapped alike."""
    path = files[arch]
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ours = load_model(settings(path, tmp_path, weights=WeightFormat.FP32)).model
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)


def test_each_layer_takes_the_kernel_nearest_its_type(files, tmp_path):
    """auto on CPU: the 4-bit types level for level in int4 (only the blocks' scale and offset rounded to
    bf16), every other type in int8; the embedding exactly the file's, in its own blocks; an int8 lm_head."""
    path = files["qwen2"]
    model = load_model(settings(path, tmp_path)).model
    assert weight_format(model) == WeightFormat.GGUF
    tensors = read_header(path)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    modules = {"attn_q": attn.q_proj, "attn_k": attn.k_proj, "attn_v": attn.v_proj, "attn_output": attn.o_proj,
               "ffn_gate": mlp.gate_proj, "ffn_up": mlp.up_proj, "ffn_down": mlp.down_proj}
    for part, module in modules.items():
        stored = tensors.dequantized(f"blk.0.{part}.weight")
        if MIXED_TYPES[part] in (QT.Q4_0, QT.Q4_1, QT.Q4_K):
            assert isinstance(module, Int4Linear)
            # bf16 keeps 8 significant bits of each block's scale and zero: the level itself is exact
            torch.testing.assert_close(module.dequantized(), stored, atol=stored.abs().max().item() * 2 ** -7, rtol=0)
            # decode's packed kernel (bf16 activations) multiplies by the same weights as prefill's GEMM
            x = torch.randn(40, module.in_features)
            torch.testing.assert_close(module(x[:4]), module(x)[:4], atol=0.02 * module(x).abs().max().item(), rtol=0)
        else:
            assert isinstance(module, Int8Linear)
            torch.testing.assert_close(module.dequantized(), stored, atol=stored.abs().max().item() / 127, rtol=0)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, Int8BlockEmbedding)
    assert torch.equal(embedding.dequantized(), tensors.dequantized("token_embd.weight"))
    assert isinstance(model.get_output_embeddings(), Int8Linear)


def test_a_llamas_int8_q_and_k_come_in_transformers_row_order(tmp_path):
    """A llama's q and k rows are interleaved per head in the file; quantized to int8 a slice of rows at a time,
    they are put back in transformers' order, as the fp32 reading puts them."""
    path = write_gguf(tmp_path / "llama-q8.gguf", "llama", types={**MIXED_TYPES, "attn_q": QT.Q8_0, "attn_k": QT.Q8_0})
    ours = load_model(settings(path, tmp_path / "gguf")).model.model.layers[0].self_attn
    exact = load_model(settings(path, tmp_path / "fp32", weights=WeightFormat.FP32)).model.model.layers[0].self_attn
    for mine, theirs in [(ours.q_proj, exact.q_proj), (ours.k_proj, exact.k_proj)]:
        assert isinstance(mine, Int8Linear)
        weight = theirs.weight
        torch.testing.assert_close(mine.dequantized(), weight, atol=weight.abs().max().item() / 127, rtol=0)


def reference_of(model: nn.Module) -> nn.Module:
    """transformers' model of `model`'s config with the weights `model`'s prefill multiplies by, as fp32
    nn.Linear / nn.Embedding: the forward the engine's full prefill must reproduce. An int4 layer's prefill
    GEMM multiplies by its bf16 copy of the weight (blend_engine/int4.py), so that copy is the reference's."""
    reference = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            state[f"{name}.weight"] = module.gemm_weight.float()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias
        elif isinstance(module, Int8Linear):
            state[f"{name}.weight"] = module.dequantized()
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias
        elif isinstance(module, Int8BlockEmbedding):
            state[f"{name}.weight"] = module.dequantized()
    state["lm_head.weight"] = model.get_output_embeddings().dequantized()
    state.update({name: p for name, p in model.named_parameters() if name not in state})
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), missing
    return reference


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_full_prefill_equals_a_reference_on_the_same_weights(arch, files, tmp_path, monkeypatch):
    """The engine's full prefill of a GGUF model (int4 and int8 layers) gives transformers' logits on the same
    weights within 1e-3 of logits of order 1-10 (fp32 GEMMs: the difference is summation order). The layers
    that see only the last token (the last layer's MLP, the lm_head) multiply their one row in fp32 here too:
    the packed kernels' bf16 activations (a step of 2^-6 at these logits) would hide a layer's error."""
    monkeypatch.setattr(weights, "MAX_PACKED_ROWS", 0)
    monkeypatch.setattr(int4, "MAX_PACKED_ROWS", 0)
    loaded = load_model(settings(files[arch], tmp_path))
    reference = reference_of(loaded.model)
    result = BlendEngine(loaded).prefill([Segment(tuple(PROMPT))], PrefillMode.FULL)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(result.logits.reshape(-1), expected, atol=1e-3, rtol=0)


# ---- refusals: said at start, before anything is allocated ----------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_kept_config_and_tokenizer_are_transformers_reading_of_the_file(arch, files, tmp_path):
    """The fast first read (transformers' header reader, its config table, the tokenizer class AutoTokenizer
    picks) keeps what AutoConfig and AutoTokenizer make of the file through their legacy reader, file for file."""
    from transformers import AutoConfig, AutoTokenizer

    path = files[arch]
    model_dir = gguf_model_dir(path, tmp_path / "cache")
    reference = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if arch == "qwen3":
        reference.head_dim = read_header(path).head_dim  # transformers maps no key_length (gguf_model_dir's fix)
    reference.save_pretrained(tmp_path / "reference")
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp_path / "reference")
    reference_files = {f.name: f.read_bytes() for f in (tmp_path / "reference").iterdir()}
    kept = {f.name: f.read_bytes() for f in model_dir.iterdir() if f.name in reference_files}
    assert kept == reference_files
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(kept)


def test_an_architecture_the_engine_does_not_run_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "gemma.gguf", "gemma3")
    with pytest.raises(GGUFError, match=r"architecture 'gemma3' is not supported.*llama, qwen2, qwen3"):
        load_model(settings(path, tmp_path / "cache"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").glob("gemma*"))


def test_a_truncated_file_is_refused(files, tmp_path):
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(files["qwen2"], cut)
    with cut.open("r+b") as f:
        f.truncate(cut.stat().st_size - 1000)
    with pytest.raises(GGUFError, match="truncated"):
        load_model(settings(cut, tmp_path / "cache"))
    with cut.open("r+b") as f:
        f.truncate(64)  # inside the header
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_model(settings(cut, tmp_path / "cache"))


def test_a_file_cut_after_its_first_load_is_refused_at_the_next(files, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copyfile(files["qwen2"], path)
    model_dir = gguf_model_dir(path, tmp_path / "cache")
    size, mtime = path.stat().st_size, path.stat().st_mtime_ns
    with path.open("r+b") as f:
        f.truncate(size - 1000)
    os.utime(path, ns=(mtime, mtime))  # the same mtime: the kept table is read, and checked against the size
    with pytest.raises(GGUFError, match="truncated"):
        cached_tensors(path, model_dir)


def test_a_tensor_type_it_does_not_read_is_refused_by_name(tmp_path):
    path = tmp_path / "iq.gguf"
    writer = GGUFWriter(path, "qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 66), np.uint8), raw_dtype=QT.IQ2_XXS)  # 256 values a row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="token_embd.weight is IQ2_XXS, which ragblend does not read; supported: "):
        read_header(path)


def test_a_catalogue_model_not_installed_says_how_to_install_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="ragblend models install qwen2.5-coder-1.5b"):
        load_model(ModelConfig(name="qwen2.5-coder-1.5b", cache_dir=tmp_path))


def test_a_catalogue_file_is_checked_by_size_and_hash_once_per_copy(tmp_path, monkeypatch):
    data = b"GGUF" + bytes(range(256)) * 4
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    model = replace(CATALOGUE["qwen2.5-coder-0.5b"], file_name="m.gguf", num_bytes=len(data),
                    sha256=catalogue.file_sha256(path))
    with pytest.raises(ValueError, match="truncated or another file; install it again"):
        verified(replace(model, num_bytes=len(data) + 1), path, tmp_path)
    with pytest.raises(ValueError, match="a damaged or another file; install it again"):
        verified(replace(model, sha256="0" * 64), path, tmp_path)
    verified(model, path, tmp_path)
    monkeypatch.setattr(catalogue, "file_sha256", lambda p: pytest.fail("hashed again"))
    verified(model, path, tmp_path)  # the same copy: its size and mtime recorded, not read again
    path.write_bytes(data[::-1])  # another file of the same size
    monkeypatch.undo()
    with pytest.raises(ValueError, match="damaged or another file"):
        verified(model, path, tmp_path)


def test_the_kept_table_serves_a_warm_start_without_parsing_the_file(files, tmp_path, monkeypatch):
    path = files["qwen2"]
    load_model(settings(path, tmp_path))
    import blend_engine.gguf_loader as gguf_loader
    monkeypatch.setattr(gguf_loader, "_parsed_header", lambda p: pytest.fail("the header parsed again"))
    loaded = load_model(settings(path, tmp_path))
    assert isinstance(loaded.model.model.layers[0].self_attn.q_proj, Int4Linear)


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process that map `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q8_0])  # int4 and int8 layers
def test_a_warm_start_maps_the_kept_weights_and_the_engine_fuses_them_without_a_copy(qtype, tmp_path):
    """The kept file is mapped, not read into fresh memory, and the layers the engine fuses (q/k/v, gate/up)
    were kept joined, so fusing them is a view of the mapping: a start copies no weights, and its logits are
    the first load's."""
    types = {name: qtype for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    path = write_gguf(tmp_path / "fusable.gguf", "qwen2", types)
    first = BlendEngine(load_model(settings(path, tmp_path / "cache")))
    expected = first.prefill([Segment(tuple(PROMPT))], PrefillMode.FULL).logits
    (kept,) = (tmp_path / "cache").rglob("packed-gguf-*.pt")
    loaded = load_model(settings(path, tmp_path / "cache"))
    ranges = mapped_ranges(kept)
    is_mapped = lambda t: any(start <= t.data_ptr() < end for start, end in ranges)  # noqa: E731
    block = loaded.model.model.layers[1]
    held = [*block.self_attn.q_proj.buffers(), *block.mlp.down_proj.buffers()]
    assert ranges and all(is_mapped(t) for t in held if t.numel())
    engine = BlendEngine(loaded)
    fused = [engine.runner.calls[1].fused_qkv, engine.runner.calls[1].fused_gate_up]
    assert all(f is not None for f in fused)
    for module in (f.__self__ for f in fused):  # the bound forward of the fused module
        for name, buffer in module.named_buffers():
            if name != "gemm_weight" or isinstance(module, Int4Linear):  # int8's bf16 copy is made at start
                assert is_mapped(buffer), name
    assert torch.equal(engine.prefill([Segment(tuple(PROMPT))], PrefillMode.FULL).logits, expected)


def test_damaged_packed_weights_are_packed_again(files, tmp_path):
    """A kept file of packed weights that cannot be read (a disk error) costs that start its speed: the GGUF
    is packed again, the same weights, and a good copy kept."""
    first = load_model(settings(files["qwen2"], tmp_path)).model
    (kept,) = tmp_path.rglob("packed-gguf-*.pt")
    kept.write_bytes(kept.read_bytes()[:1000])
    again = load_model(settings(files["qwen2"], tmp_path)).model
    assert torch.equal(again.model.layers[0].self_attn.q_proj.nibbles, first.model.layers[0].self_attn.q_proj.nibbles)
    assert kept.stat().st_size > 1000


def test_packed_files_no_start_has_used_for_weeks_are_deleted_and_the_used_one_kept(files, tmp_path):
    """Each change of the packing key (torch, the CPU, the int4 layout) writes a new packed file: the old ones
    go once no start has read them for two weeks, with a dead writer's partial copy."""
    load_model(settings(files["qwen2"], tmp_path))
    (kept,) = tmp_path.rglob("packed-gguf-*.pt")
    older_layout = kept.with_name("packed-gguf-000000000000.pt")
    other_release = kept.with_name("packed-gguf-111111111111.pt")  # still used by a release beside this one
    dead_writer = kept.with_name(f".{kept.name}.99999")
    for path in (older_layout, other_release, dead_writer):
        path.write_bytes(b"weights")
    weeks_ago = time.time() - 30 * 86400
    for path in (older_layout, dead_writer, kept):  # `kept` is read below, which marks it used
        os.utime(path, (weeks_ago, weeks_ago))
    again = load_model(settings(files["qwen2"], tmp_path)).model
    assert isinstance(again.model.layers[0].self_attn.q_proj, Int4Linear)
    assert kept.exists() and kept.stat().st_mtime > weeks_ago
    assert other_release.exists()
    assert not older_layout.exists() and not dead_writer.exists()
