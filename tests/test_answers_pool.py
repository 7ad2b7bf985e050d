"""`ragblend bench answers-pool`: runs on other question sets read as one (known records, no server)."""

from __future__ import annotations

import json

from app.cli import main


def answer(question: str, setting: str, right: bool, part: str = "docs_test", out_of_scope: bool = False) -> dict:
    return {"part": part, "question": question, "document": None if out_of_scope else "d", "setting": setting,
            "repeat": 0, "error": None, "answer": f"{setting} says {right}", "finish_reason": "stop",
            "ran_to_cap": False, "ttft_ms": 100.0, "server_ttft_ms": 90.0, "mode": "blend", "completion_tokens": 5,
            "prompt_tokens": 300, "sources": [], "chunks": [], "right": right,
            "inside": None if out_of_scope else True, "source_top": None if out_of_scope else True,
            "source_any": None if out_of_scope else True, "refused": False, "out_of_scope": out_of_scope}


def write_run(path, set_name: str, answers: list[dict], settings=("default", "full"), model: str = "m",
              max_tokens: int | None = None) -> str:
    path.write_text(json.dumps({
        "bench": "answers", "set": f"bench/data/{set_name}/questions.json", "model": model, "split": "all",
        "settings": [{"name": s} for s in settings], "repeats": 1, "max_tokens": max_tokens,
        "documents": {"d": {"file": "d.md"}}, "answers": answers}))
    return str(path)


def test_runs_on_other_sets_are_pooled_question_by_question(tmp_path, capsys):
    # the same question ids in both sets: they are other questions, and count apart
    one = write_run(tmp_path / "a.json", "set_a", [
        answer("q1", "default", True), answer("q1", "full", True),
        answer("q2", "default", False), answer("q2", "full", True),
        answer("oos", "default", True, out_of_scope=True), answer("oos", "full", False, out_of_scope=True),
        answer("q3", "default", True, part="docs_dev"), answer("q3", "full", False, part="docs_dev")])
    two = write_run(tmp_path / "b.json", "set_b", [
        answer("q1", "default", False), answer("q1", "full", True),
        answer("q2", "default", False), answer("q2", "full", True),
        answer("q1", "other", True)], settings=("default", "full", "other"))
    out = tmp_path / "pooled.json"
    assert main(["bench", "answers-pool", one, two, "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())
    assert pooled["sets"] == ["set_a", "set_b"] and pooled["settings"] == ["default", "full"]  # 'other': one run only
    test = pooled["results"]["docs_test"]
    assert test["default"]["num_right"] == 1 and test["full"]["num_right"] == 4  # of 4 in-scope questions
    assert test["default"]["num_answers"] == 4 and test["default"]["num_questions"] == 5
    assert test["default"]["num_oos_refused"] == 1 and test["full"]["num_oos_refused"] == 0
    pair = pooled["paired"]["docs_test"]["settings"]["full"]
    assert (pair["num_pairs"], pair["only_this"], pair["only_against"], pair["both_right"]) == (4, 3, 0, 1)
    assert pooled["results"]["docs_dev"]["default"]["num_right"] == 1  # one run's dev half alone
    printed = capsys.readouterr().out
    assert "documents, test half" in printed and "+3 / -0" in printed


def test_settings_are_picked_and_the_first_is_paired_against(tmp_path):
    one = write_run(tmp_path / "a.json", "set_a", [answer("q1", "default", False), answer("q1", "full", True)])
    out = tmp_path / "pooled.json"
    assert main(["bench", "answers-pool", one, "--settings", "full,default", "--out", str(out)]) == 0
    pooled = json.loads(out.read_text())
    assert pooled["paired"]["docs_test"]["against"] == "full"
    assert pooled["paired"]["docs_test"]["settings"]["default"]["only_against"] == 1


def test_what_cannot_be_pooled_is_refused_with_its_reason(tmp_path, capsys):
    good = write_run(tmp_path / "a.json", "set_a", [answer("q1", "default", True)], settings=("default",))
    (tmp_path / "bad.json").write_text(json.dumps({"bench": "engine"}))
    (tmp_path / "broken.json").write_text("{")
    other = write_run(tmp_path / "c.json", "set_c", [answer("q1", "full", True)], settings=("full",))
    cases = [
        ([good, str(tmp_path / "bad.json")], "not a `ragblend bench answers` result"),
        ([good, str(tmp_path / "broken.json")], "broken.json"),
        ([good, str(tmp_path / "missing.json")], "missing.json"),
        ([good, other], "no setting in common"),
        ([good, "--settings", "full"], "not asked by every run: full"),
        ([good, good], "a set appears twice"),
        ([good, write_run(tmp_path / "d.json", "set_d", [], settings=("default",), model="other")],
         "the runs' models differ (m, other)"),
        ([good, write_run(tmp_path / "e.json", "set_e", [], settings=("default",), max_tokens=64)],
         "the runs' max_tokens differ (64, None)"),
    ]
    for argv, message in cases:
        assert main(["bench", "answers-pool", *argv]) == 2, message
        assert message in capsys.readouterr().err
