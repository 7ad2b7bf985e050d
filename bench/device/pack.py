"""What a device call carries for the server end to end, within its 64 MiB (docs/benchmarks/gpu.md): `pack`, here,
writes `.device/` (the tokenizer alone, the embedder's configuration without its weights, the data set) and
`.whl/` (the wheels of the server's pure-Python dependencies the GPU image lacks), both git-ignored, and
checks the size; `embedder`, there, writes a loadable embedder (random weights, seeded, unless packed).

    python -m bench.device.pack pack [--embedder config|half] [--no-wheels] [--out .device]
    python -m bench.device.pack embedder --out /tmp/ragblend-embedder [--pack .device]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 64 * 2**20  # what one device call's working tree may hold
# What the server imports that the GPU image lacks (its package list: the device tool's KINDS.md),
# checked by running `ragblend serve` with every other package hidden. Each wheel without its
# dependencies: those the image has are not carried.
WHEELS = (
    "pydantic", "pydantic-core", "pydantic-settings", "python-dotenv", "annotated-types", "typing-inspection",
    "fastapi", "starlette", "opentelemetry-api", "uvicorn", "python-multipart", "swagger-ui-bundle-v2",  # the API
    "redis", "zstandard", "gguf",  # the KV store's, the loader's
    "faiss-cpu",  # the vector index
    "trafilatura", "courlan", "htmldate", "justext", "lxml_html_clean", "tld", "babel", "html2text",  # HTML uploads
    "pypdf", "python-docx",  # PDF and DOCX uploads
)
PIP_PLATFORM = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64")
EMBEDDER_SKIPPED = {"model.safetensors", "pytorch_model.bin", "README.md", "data_config.json", ".gitattributes"}


def pack_tokenizer(out: Path, source: Path | None) -> Path:
    """The tokenizer files of `source` (a model directory; default: the embedded SmolLM2's, converted
    once from its GGUF) saved into out/tokenizer."""
    from transformers import AutoTokenizer

    if source is None:
        from blend_engine.config import ModelConfig
        from blend_engine.loader import embedded_tokenizer_dir

        source = embedded_tokenizer_dir(ModelConfig().cache_dir)
    target = out / "tokenizer"
    shutil.rmtree(target, ignore_errors=True)
    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(target)
    return target


def pack_embedder(out: Path, name: str, weights: str) -> Path:
    """The embedder's configuration files into out/embedder; with `weights` "half" its weights in fp16."""
    from retrieval.embedder import resolve_model_path

    source = resolve_model_path(name)
    target = out / "embedder"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=lambda _, names: [n for n in names if n in EMBEDDER_SKIPPED])
    if weights == "half":
        from safetensors.torch import load_file, save_file

        tensors = load_file(source / "model.safetensors")
        save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
                  target / "model.safetensors")
    return target


def fetch_wheels(directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PIP_PLATFORM,
                    "-d", str(directory), *WHEELS], check=True)


def carried_bytes(root: Path, extra: list[Path]) -> int:
    """Bytes of what a device call carries from `root`: git's tracked files and the untracked ones it
    does not ignore, plus `extra` (ignored folders named in `carry`)."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    total = sum((root / name).stat().st_size for name in set(listed) if name and (root / name).is_file())
    for path in extra:
        if path.is_dir():
            total += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return total


def pack(args: argparse.Namespace) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"tokenizer: {pack_tokenizer(out, args.tokenizer)}")
    print(f"embedder ({args.embedder}): {pack_embedder(out, args.embedder_name, args.embedder)}")
    if args.data is not None:
        (out / "data").mkdir(exist_ok=True)
        shutil.copy(args.data, out / "data" / args.data.name)
    wheels = REPO_ROOT / ".whl"
    if not args.no_wheels:
        fetch_wheels(wheels)
    size = carried_bytes(REPO_ROOT, [out, wheels] if out.is_relative_to(REPO_ROOT) else [wheels])
    print(f"a device call carries {size / 2**20:.1f} MiB of {LIMIT_BYTES / 2**20:.0f} "
          f"(name {out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out} and .whl in `carry`)")
    if size > LIMIT_BYTES:
        print("over the limit: pack less (--embedder config)", file=sys.stderr)
        return 1
    return 0


def embedder(args: argparse.Namespace) -> int:
    """A loadable embedder directory (fp32) from the pack's: its weights converted where packed, else
    random (seeded) from its configuration."""
    import torch
    from transformers import AutoConfig, AutoModel

    source, target = args.pack / "embedder", args.out
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=lambda _, names: [n for n in names if n in EMBEDDER_SKIPPED])
    if (source / "model.safetensors").is_file():
        model = AutoModel.from_pretrained(source, dtype=torch.float32, local_files_only=True)
        kind = "packed weights, fp32"
    else:
        torch.manual_seed(0)
        model = AutoModel.from_config(AutoConfig.from_pretrained(source, local_files_only=True))
        kind = "random weights (seed 0)"
    model.save_pretrained(target)
    print(f"embedder: {target} ({kind})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack", help="here: .device/ and .whl/, and the size check")
    packing.add_argument("--out", type=Path, default=REPO_ROOT / ".device")
    packing.add_argument("--tokenizer", type=Path, default=None, help="a model directory (default: embedded SmolLM2)")
    packing.add_argument("--embedder-name", default="all-minilm-l6-v2", help="retrieval.embedder to pack")
    packing.add_argument("--embedder", choices=["config", "half"], default="config",
                         help="config: no weights (random ones there); half: the weights in fp16")
    packing.add_argument("--data", type=Path, default=Path("../shared/data/musique_dev.json"))
    packing.add_argument("--no-wheels", action="store_true", help="fetch no wheels (a CPU dry run)")
    making = commands.add_parser("embedder", help="there: the embedder directory the server loads")
    making.add_argument("--pack", type=Path, default=REPO_ROOT / ".device")
    making.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return pack(args) if args.command == "pack" else embedder(args)


if __name__ == "__main__":
    raise SystemExit(main())
