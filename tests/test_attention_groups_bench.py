"""`ragblend bench attention-groups`: every grouping computes the same attention, the summary says what ran."""

import json

from app.cli import main


def test_attention_groups_bench_runs_every_grouping_of_every_shape(tmp_path, capsys):
    out = tmp_path / "groups.json"
    assert main(["bench", "attention-groups", "--rounds", "1", "--dtype", "float32", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["bench"] == "attention-groups" and len(summary["shapes"]) == 5
    for shape in summary["shapes"]:
        for sizes in shape["groups"].values():
            assert sum(sizes) == shape["queries"]
        assert shape["groups"]["one call"] == [shape["queries"]]
        assert max(shape["max_abs_diff_vs_before"].values()) < 1e-4  # float32: summation order only
        assert set(shape["median_ms"]) == {"before", "grouped", "one call"}
