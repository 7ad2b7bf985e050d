"""bench/'s shape (issue 64): every `ragblend bench` command answers --help, `ragblend bench --help` lists them
under the question their group answers, each module sits in a group and imports no other group's benches
(the harness alone), there is no import circle and no file over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from app.cli import COMMANDS, main
from bench import GROUPS

ROOT = Path(__file__).resolve().parent.parent
BENCH_COMMANDS = [path for path in COMMANDS if path[0] == "bench"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "bench").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bench"):
            found |= {t for t in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if t in known}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    return found - {"bench"}


@pytest.mark.parametrize("path", BENCH_COMMANDS, ids=lambda p: " ".join(p))
def test_every_bench_command_answers_help(path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"usage: ragblend {' '.join(path)}")


def test_bench_help_lists_the_commands_by_group(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert all(f"{group}: {question}" in out for group, question in GROUPS.items())
    for path in BENCH_COMMANDS:
        module = COMMANDS[path][0]
        assert module.split(".")[1] in GROUPS, module


def test_groups_use_the_harness_alone_without_a_circle():
    modules = _modules()
    graph = {name: _imports(path, set(modules)) for name, path in modules.items()}
    for name, targets in graph.items():
        group = name.split(".")[1] if "." in name else None
        for target in targets:
            assert target.split(".")[1] in (group, "harness"), f"{name} imports {target}"
    done: set[str] = set()

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"import circle: {' -> '.join((*stack, name))}"
        if name not in done:
            for target in graph[name]:
                visit(target, (*stack, name))
            done.add(name)

    for name in graph:
        visit(name, ())


def test_no_bench_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "bench").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}
