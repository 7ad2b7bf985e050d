"""`ragblend bench compare REV` end to end on a tiny random model: REV is this branch's HEAD, its worktree
made under a temporary cache dir and run under this interpreter (--python: no venv is installed), its
server against this checkout's; and the build, statistics and idle-CPU pieces on their own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.cli import main
from bench.serving import build as compare_build, compare as compare_bench
from bench.serving.compare import Side
from bench.harness.servers import REPO_ROOT, process_tree_cpu_s
from test_server_bench import TINY_MODEL, dataset

ROUNDS, CLIENTS = 2, 2
MODEL_FROM_YAML = True  # the servers' model is TINY_MODEL, from a YAML config or load_settings


@pytest.fixture
def head_worktree(tmp_path):
    """HEAD's worktree where `bench compare` keeps it, made beforehand; removed (and unregistered) after."""
    sha = compare_build.resolve("HEAD")
    path = compare_build.worktree(sha, tmp_path / "cache" / sha / "src", is_creating=True)
    yield sha, path
    compare_build.remove_worktree(path)


def test_compare_measures_both_builds_in_turn_and_writes_ratios(head_worktree, tmp_path, capsys):
    sha, root = head_worktree
    # REV's server must run REV's code: mark its copy so that its /v1/models says so
    router = root / "app" / "models" / "api_router.py"
    router.write_text(router.read_text().replace("id=components.model_id", 'id=components.model_id + "-rev"'))
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {json.dumps(TINY_MODEL)}\n")
    out = tmp_path / "results" / "compare.json"
    code = main(["bench", "compare", "HEAD", "--skip-build", "--python", sys.executable,
                 "--cache-dir", str(tmp_path / "cache"), "--config", str(config),
                 "--data", dataset(tmp_path / "data.json", num_questions=1 + CLIENTS + 2 * ROUNDS),
                 "--rounds", str(ROUNDS), "--clients", str(CLIENTS), "--passages", "2", "--max-tokens", "3",
                 "--settle-s", "0", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert json.loads(out.read_text()) == summary
    assert summary["ignore_eos"] is True and summary["max_tokens"] == 3  # every answer 3 tokens, on both builds
    rev, current = summary["builds"]["rev"], summary["builds"]["current"]
    assert rev["sha"] == sha and rev["root"] == str(root) and rev["python"] == str(Path(sys.executable).absolute())
    assert current["root"] == str(REPO_ROOT) and current["sha"] == compare_build.git(REPO_ROOT, "rev-parse", "HEAD")
    assert rev["model"] == "random-rev" and current["model"] == "random"  # each server ran its own build's code
    for info in (rev, current):
        assert info["num_errors"] == 0 and info["ingest_s"] > 0 and info["mean_prompt_tokens"] > 40
        assert sum(info["modes"].values()) == ROUNDS * (3 + CLIENTS)  # every answer measured, none of the warm-up's
        assert "null" not in info["modes"]  # the model answered each, the retrieved asks too (chunks were found)
    keys = [m.key for m in compare_bench.measures(CLIENTS)]
    assert list(summary["measures"]) == keys
    for key, m in summary["measures"].items():
        for side in ("rev", "current"):
            values = m[side]["values"]
            assert len(values) == ROUNDS and all(v is not None and v > 0 for v in values), (key, side)
            assert m[side]["median"] == pytest.approx(sorted(values)[0] / 2 + sorted(values)[1] / 2)
            assert m[side]["min"] == min(values) and m[side]["max"] == max(values)
        # the ratios: current over REV, round by round, then their spread
        expected = [c / r for c, r in zip(m["current"]["values"], m["rev"]["values"])]
        assert m["ratio"]["values"] == pytest.approx(expected)
        assert m["ratio"]["min"] == pytest.approx(min(expected)) and m["ratio"]["max"] == pytest.approx(max(expected))
    p50, p95 = summary["measures"]["clients_ttft_p50_ms"], summary["measures"]["clients_ttft_p95_ms"]
    assert all(a <= b for side in ("rev", "current") for a, b in zip(p50[side]["values"], p95[side]["values"]))
    # one at a time, who goes first alternating from part to part and round to round
    order = [(s["round"], s["part"], s["build"]) for s in summary["schedule"]]
    assert order == [(0, "one_user", "rev"), (0, "one_user", "current"), (0, "clients", "current"),
                     (0, "clients", "rev"), (1, "one_user", "current"), (1, "one_user", "rev"),
                     (1, "clients", "rev"), (1, "clients", "current")]
    assert all(s["idle_build"] != s["build"] and s["idle_cpu_s"] >= 0 for s in summary["schedule"])
    # the idle server's CPU is the idle one's: next to nothing, where the working one's is about its wall time
    assert sum(s["idle_cpu_s"] for s in summary["schedule"]) <= 0.3 * sum(s["wall_s"] for s in summary["schedule"])
    assert summary["idle"]["cpu_s_max"] == max(s["idle_cpu_s"] for s in summary["schedule"])
    table = "\n".join(lines[:-1])
    assert "current/REV" in table and f"{CLIENTS} clients: TTFT p95" in table and "idle server" in table


def test_compare_statistics_on_known_figures():
    values = {Side.REV: {m.key: [100.0, 200.0, 400.0] for m in compare_bench.measures(8)},
              Side.CURRENT: {m.key: [50.0, 300.0, None] for m in compare_bench.measures(8)}}
    out = compare_bench.compare_measures(values, 8)
    ttft = out["ttft_first_ms"]
    assert ttft["rev"]["median"] == 200 and ttft["rev"]["p25"] == 150 and ttft["rev"]["p75"] == 300
    assert ttft["current"]["median"] == 175 and ttft["current"]["min"] == 50  # the round without a figure left out
    assert ttft["ratio"]["values"] == [0.5, 1.5, None] and ttft["ratio"]["median"] == 1.0
    assert out["decode_tokens_per_s"]["better"] == "higher" and ttft["better"] == "lower"
    assert out["clients_wall_s"]["label"] == "8 clients: round wall"
    schedule = [{"idle_cpu_s": 0.1, "wall_s": 2.0}, {"idle_cpu_s": 0.3, "wall_s": 3.0}, {"idle_cpu_s": None, "wall_s": 1}]
    idle = compare_bench.idle_summary(schedule)
    assert idle["cpu_s_max"] == 0.3 and idle["cpu_share_max"] == pytest.approx(0.1)
    assert idle["cpu_s_total"] == pytest.approx(0.4)


def test_question_layout_keeps_the_parts_apart():
    args = compare_bench.argparse.Namespace(questions=3, clients=2, rounds=4)
    assert compare_bench.num_questions(args) == 1 + 3 + 2 * 4
    assert compare_bench.pool_indices(args) == [1, 2, 3]
    assert [compare_bench.concurrent_indices(r, args) for r in range(3)] == [[1, 2], [3, 1], [2, 3]]
    firsts = [compare_bench.first_ask_index(r, args) for r in range(4)]
    assert firsts == [4, 5, 6, 7]  # never the repeated question (0) nor the pool's
    retrieved = [compare_bench.retrieved_ask_index(r, args) for r in range(4)]
    assert retrieved == [8, 9, 10, 11]  # nor the named first asks'
    body = compare_bench.retrieved_body(compare_bench.Question("q?", ("a",), ("p1", "p2")), 8,
                                        compare_bench.argparse.Namespace(max_tokens=4, ignore_eos=True,
                                                                         prefix_cache="off", mode=None))
    assert "chunk_ids" not in body and body["question"] == "q?" and body["prefix_cache"] is False


def test_compare_refuses_bad_arguments_and_revisions(tmp_path, capsys):
    data = dataset(tmp_path / "data.json", num_questions=5)
    assert main(["bench", "compare", "HEAD", "--data", data, "--clients", "4", "--questions", "2"]) == 2
    assert "each client asks its own" in capsys.readouterr().err
    assert main(["bench", "compare", "HEAD", "--data", data, "--max-tokens", "1"]) == 2
    assert "--max-tokens >= 2" in capsys.readouterr().err
    assert main(["bench", "compare", "HEAD", "--data", data, "--rounds", "5"]) == 2  # 1 + 8 + 2 * 5 questions needed
    assert "19 needed" in capsys.readouterr().err
    common = ["--data", data, "--clients", "1", "--rounds", "1", "--cache-dir", str(tmp_path / "cache")]
    assert main(["bench", "compare", "no-such-revision-anywhere", *common]) == 1
    assert "names no commit" in capsys.readouterr().err
    assert main(["bench", "compare", "HEAD", "--skip-build", *common]) == 1
    assert "run without --skip-build" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()  # --skip-build made nothing


def test_the_venv_is_the_makefiles_recipe_and_its_stamp_is_reused(tmp_path):
    """install_steps is the Makefile's $(STAMP) recipe (so both install alike); a venv with its stamp is
    taken as it is, one without is not used under --skip-build."""
    recipe = (REPO_ROOT / "Makefile").read_text().split("$(STAMP): pyproject.toml\n", 1)[1].split("\n\n", 1)[0]
    venv, root = tmp_path / "venv", tmp_path / "src"
    expected = []
    for line in recipe.strip().splitlines()[:-1]:  # the last line touches the stamp
        line = line.strip().replace("$(PY)", "python3").replace("$(VENV)", str(venv))
        line = line.replace("$(BIN)/pip", f"{venv}/bin/python -m pip").replace("'.[dev]'", f"{root}[dev]")
        expected.append(line.split())
    assert compare_build.install_steps(root, venv) == expected
    with pytest.raises(compare_build.BuildError, match="no finished venv"):
        compare_build.virtualenv(root, venv, is_creating=False)
    (venv / "bin").mkdir(parents=True)
    (venv / compare_build.STAMP).write_text("built\n")
    assert compare_build.virtualenv(root, venv, is_creating=True) == (venv / "bin" / "python", False)


def test_a_worktree_at_another_commit_is_refused(head_worktree):
    sha, path = head_worktree
    assert compare_build.worktree(sha, path, is_creating=False) == path  # reused as it is
    parent = compare_build.resolve("HEAD~1")
    with pytest.raises(compare_build.BuildError, match="not " + parent):
        compare_build.worktree(parent, path, is_creating=True)


def test_process_tree_cpu_counts_a_busy_child():
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                              "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\ntime.sleep(60)"])
    try:
        time.sleep(0.5)
        before = process_tree_cpu_s(child.pid)
        time.sleep(1.5)
        after = process_tree_cpu_s(child.pid)
        # the grandchild's spinning, counted (the child itself sleeps); low bound: the cores may be busy
        assert before is not None and after - before > 0.05
    finally:
        for line in Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split():
            os.kill(int(line), 9)
        child.kill()
        child.wait()
    assert process_tree_cpu_s(child.pid) is None


def test_a_worktree_deleted_by_hand_is_made_again(tmp_path):
    sha = compare_build.resolve("HEAD")
    path = tmp_path / sha / "src"
    compare_build.worktree(sha, path, is_creating=True)
    try:
        shutil.rmtree(path)  # its registration stays in the repository
        assert compare_build.worktree(sha, path, is_creating=True) == path
        assert compare_build.git(path, "rev-parse", "HEAD") == sha
    finally:
        compare_build.remove_worktree(path)


def test_a_worktree_whose_registration_is_gone_is_made_again(tmp_path):
    """A cached worktree outlives its repository's record of it (the repository cloned again, or its
    worktrees pruned): git no longer reads it, so it is made again; --skip-build says so."""
    sha = compare_build.resolve("HEAD")
    path = tmp_path / sha / "src"
    compare_build.worktree(sha, path, is_creating=True)
    try:
        compare_build.git(REPO_ROOT, "worktree", "remove", "--force", str(path))
        shutil.copytree(REPO_ROOT / "bench", path / "bench")  # the orphan: files, and a .git that points nowhere
        (path / ".git").write_text(f"gitdir: {tmp_path / 'gone'}\n")
        with pytest.raises(compare_build.BuildError, match="no longer a worktree"):
            compare_build.worktree(sha, path, is_creating=False)
        assert compare_build.worktree(sha, path, is_creating=True) == path
        assert compare_build.git(path, "rev-parse", "HEAD") == sha
    finally:
        compare_build.remove_worktree(path)


def test_unmet_requirements_names_what_this_interpreter_lacks(tmp_path):
    """REV's declared dependencies against this interpreter's distributions: markers evaluated, versions
    compared, a missing package or file said so."""
    import numpy

    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = [\n'
        '  "numpy",\n'  # met
        '  "packaging>=1",\n'  # met
        '  "numpy<1",\n'  # installed, too new
        '  "no-such-distribution-anywhere>=1",\n'  # not installed
        '  "another-missing-one; python_version < \'3\'",\n'  # a marker false here: not asked for
        ']\n')
    assert compare_build.unmet_requirements(tmp_path) == [
        f"numpy<1 ({numpy.__version__} installed)", "no-such-distribution-anywhere>=1 (not installed)"]
    assert "no readable [project]" in compare_build.unmet_requirements(tmp_path / "nowhere")[0]


def test_rev_shares_this_interpreter_unless_it_lacks_revs_dependencies(head_worktree, tmp_path, capsys):
    """--venv shared (the default): HEAD, whose requirements this interpreter has, runs under it and no
    venv is made; a requirement it lacks (or --venv own) asks for REV's own venv, which --skip-build
    refuses to make; the JSON's description says which ran it and why."""
    sha, root = head_worktree
    cache = tmp_path / "cache"
    shared = compare_build.build("HEAD", cache, is_skipping_build=True)
    assert (shared.python, shared.interpreter, shared.unmet) == (Path(sys.executable),
                                                                 compare_build.Interpreter.SHARED, ())
    assert shared.describe()["interpreter"] == "shared" and not (cache / sha / "venv").exists()
    with pytest.raises(compare_build.BuildError, match="no finished venv"):
        compare_build.build("HEAD", cache, is_skipping_build=True, interpreter=compare_build.Interpreter.OWN)
    pyproject = root / "pyproject.toml"
    missing = '    "no-such-distribution-anywhere>=1",\n'
    pyproject.write_text(pyproject.read_text().replace("dependencies = [\n", "dependencies = [\n" + missing, 1))
    capsys.readouterr()
    with pytest.raises(compare_build.BuildError, match="no finished venv"):
        compare_build.build("HEAD", cache, is_skipping_build=True)
    assert "lacks no-such-distribution-anywhere>=1 (not installed)" in capsys.readouterr().err
    (cache / sha / "venv" / "bin").mkdir(parents=True)
    (cache / sha / "venv" / compare_build.STAMP).write_text("built\n")
    own = compare_build.build("HEAD", cache, is_skipping_build=True)
    assert own.python == cache / sha / "venv" / "bin" / "python" and own.interpreter is compare_build.Interpreter.OWN
    assert own.describe()["unmet"] == ["no-such-distribution-anywhere>=1 (not installed)"]
