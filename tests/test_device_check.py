"""The prepared GPU check (bench/device/check.sh) run dry on CPU: every step, with a tiny random model,
tiny sizes and the pack made on the fly (tokenizer, embedder config, data: bench/device/pack.py), so
that the script a lent GPU runs does not rot between the calls that do. What a device call brings
back must be few files ($OUT): the tables, the JSON and one archive."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.device.pack import carried_bytes, main as device_pack
from bench.device.summary import TARGETS

REPO_ROOT = Path(__file__).resolve().parents[1]
STEPS = ["tests", "prefill7b", "prefill8b", "engine7b", "decode8b", "server"]
TABLES = ["## Targets", "## Prefill, ", "## Engine bench, ", "## Batched decode, ", "## Server, random",
          "## Server, per mode", "## Server, requests/s per mode", "## KV store after the request stream"]
WORDS = ("harbour lantern orchard basalt meridian copper violet glacier thistle ember quarry saffron "
         "lagoon falcon marble juniper").split()


def mini_data(path: Path) -> Path:
    """Two MuSiQue-shaped questions of two passages each (~80 words a passage)."""
    items = []
    for q in range(2):
        ctxs = [{"title": f"Place {q}-{p}", "text": " ".join(WORDS[(q + p + i) % len(WORDS)] for i in range(80))}
                for p in range(2)]
        items.append({"question": f"Where is the {WORDS[q]}?", "answers": [WORDS[q]], "ctxs": ctxs})
    path.write_text(json.dumps(items))
    return path


@pytest.mark.slow
def test_the_device_check_runs_dry_on_cpu_and_brings_back_its_tables(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "WORK": str(work), "PYTHON": sys.executable,
           "PACK": str(tmp_path / "no-pack"), "DATA": str(mini_data(tmp_path / "mini.json"))}
    run = subprocess.run(["bash", "bench/device/check.sh", "--dry-run"], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["device_check.tar.gz", "summary.json", "summary.md"]
    for step in STEPS:
        assert f"== {step}: exit 0 in" in run.stdout, run.stdout[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    figures = summary["figures"]
    assert summary["dry_run"] is True
    assert [s["step"] for s in figures["steps"]] == STEPS and all(s["exit"] == 0 for s in figures["steps"])
    assert "passed" in figures["tests"]
    for name in ("prefill_7b", "prefill_8b", "engine_7b", "decode_8b", "server", "server_modes", "server_throughput",
                 "server_kv"):
        assert name in figures, name
    prefill = figures["prefill_7b"]["prefill"]
    assert set(prefill["ms"]) == {f"{m}_{g}" for m in ("full", "reuse", "blend") for g in ("eager", "graphed")}
    assert {row["batch_size"] for row in figures["decode_8b"]["graphed"]} == {1, 2}
    assert figures["server_kv"]["hits"]  # the stored chunks were read back under the request stream
    assert set(figures["server_modes"]["results"]) == {"full", "blend", "reuse"}
    throughput = figures["server_throughput"]["throughput"]
    assert throughput["clients"] == 2 and throughput["ratios"]["blend/full"]["requests_per_s"]["median"] > 0
    targets = {t["name"]: t for t in summary["targets"]}
    assert len(targets) == len(TARGETS)
    # measured in the dry run: all but the host-over-GPU time (no GPU) and the 16-client and batch-16
    # figures (its sizes stop at 2)
    unmeasured = {t["name"] for t in summary["targets"] if t["value"] is None}
    assert unmeasured == {"a reuse prefill's host time over its GPU time, 7B (graphed)",
                          "batch-16 decode step over batch-1, 3k-token caches, Llama-3-8B (GQA)",
                          "16 clients: blend's requests/s over full's (server)"}

    tables = (out / "summary.md").read_text()
    assert tables.startswith("# Device check (DRY RUN")
    for title in TABLES:
        assert title in tables, title
    with tarfile.open(out / "device_check.tar.gz") as archive:
        names = set(archive.getnames())
    for step in STEPS:
        assert f"./{step}.log" in names
    assert "./server/server_modes.json" in names and not any("embedder" in n for n in names)


def test_the_pack_holds_the_tokenizer_the_embedder_config_and_the_data_and_its_size_is_counted(tmp_path):
    data = mini_data(tmp_path / "mini.json")
    pack = tmp_path / "pack"
    assert device_pack(["pack", "--out", str(pack), "--no-wheels", "--data", str(data)]) == 0
    assert (pack / "tokenizer" / "tokenizer.json").is_file()
    assert (pack / "embedder" / "config.json").is_file() and not (pack / "embedder" / "model.safetensors").exists()
    assert (pack / "data" / "mini.json").read_text() == data.read_text()
    tracked = carried_bytes(REPO_ROOT, [])
    assert carried_bytes(REPO_ROOT, [pack]) - tracked == sum(f.stat().st_size for f in pack.rglob("*") if f.is_file())
    # the embedder the server loads there: random weights from the packed configuration
    made = tmp_path / "embedder"
    assert device_pack(["embedder", "--pack", str(pack), "--out", str(made)]) == 0
    from configs.enums import EmbedderRuntime
    from retrieval.embedder import Embedder

    vectors = Embedder(made, runtime=EmbedderRuntime.TORCH).encode(["a harbour lantern", "an orchard"])
    assert vectors.shape == (2, 384)


def test_a_random_model_reads_its_prompts_with_the_tokenizer_it_is_given(tmp_path):
    from transformers import AutoTokenizer

    from blend_engine.config import ModelConfig
    from blend_engine.engine import BlendEngine

    data = mini_data(tmp_path / "mini.json")
    assert device_pack(["pack", "--out", str(tmp_path / "pack"), "--no-wheels", "--data", str(data)]) == 0
    directory = tmp_path / "pack" / "tokenizer"
    engine = BlendEngine.from_config(ModelConfig(name="random:tiny-llama", device="cpu", tokenizer=directory))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert engine.tokenize("a harbour lantern") == tokenizer("a harbour lantern", add_special_tokens=False)["input_ids"]
    assert engine.model.config.vocab_size >= len(tokenizer)  # grown from tiny-llama's 256
    assert engine.model_name.startswith("random:tiny-llama:seed0:tokenizer-")  # the KV fingerprint follows it
    segments = engine.build_segments("Where is the harbour?", [])
    assert engine.prefill(segments).logits.shape == (engine.model.config.vocab_size,)


def test_model_tokenizer_is_refused_for_a_model_with_its_own_and_a_missing_directory_is_named(tmp_path):
    from pydantic import ValidationError

    from blend_engine.config import ModelConfig
    from blend_engine.loader import load_model

    with pytest.raises(ValidationError, match="model.tokenizer is for random:<shape> models"):
        ModelConfig(name="smollm2", tokenizer=tmp_path)
    with pytest.raises(FileNotFoundError, match="model.tokenizer: no directory"):
        load_model(ModelConfig(name="random:tiny-llama", device="cpu", tokenizer=tmp_path / "missing"))
