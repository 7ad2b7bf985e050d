"""`ragblend bench server` on tiny inputs: two real servers (a tiny random model) over loopback, 2
questions, a few tokens, 1 and 2 clients; and its statistics on hand-made answers, where every figure is known."""

from __future__ import annotations

import json
import statistics

import pytest

from app.cli import main
from app.testing import LiveServer
from bench.serving import server as server_bench
from bench.harness.client import StreamedAnswer
from bench.serving.report import Chat, Round, level_stats, ratio_rows, target_checks
from configs.settings import load_settings

LEVEL_KEYS = {"clients", "num_rounds", "num_requests", "num_errors", "errors", "ttft_p50_ms", "ttft_p95_ms",
              "itl_p50_ms", "itl_p95_ms", "itl_max_ms", "queue_p50_ms", "queue_p95_ms", "tokens_per_s", "requests_per_s",
              "requests_per_s_rounds",
              "wall_s", "wall_s_rounds", "completion_tokens", "decode_tokens_per_s_p50", "server_ttft_p50_ms",
              "server_prefill_p50_ms", "mean_prompt_tokens", "modes"}
RATIO_KEYS = {"clients", "ttft_p50_vs_baseline", "ttft_p95_vs_baseline", "tokens_per_s_vs_baseline",
              "decode_tokens_per_s_vs_baseline", "tokens_per_s_vs_one_client", "baseline_tokens_per_s_vs_one_client"}
TINY_MODEL = {"name": "random:tiny-llama", "device": "cpu"}
MODEL_FROM_YAML = True  # the servers' model is TINY_MODEL, from a YAML config or load_settings
WORDS = ("the river flows past an old mill near the town of harlow where people trade wool and the bridge "
         "was painted red in the spring by a team of workers from the valley").split()


def dataset(path, num_questions: int = 3) -> str:
    """MuSiQue-shaped questions with 3 passages each."""
    items = [{"question": f"where is mill number {qi}?", "answers": ["harlow"],
              "ctxs": [{"title": f"t{qi}{pi}", "text": " ".join(WORDS[pi + qi:] + WORDS[: pi + qi]) * 2}
                       for pi in range(3)]} for qi in range(num_questions)]
    path.write_text(json.dumps(items))
    return str(path)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The server and its baseline: both the tiny model ."""
    settings = [load_settings(data_dir=tmp_path_factory.mktemp(name), model=TINY_MODEL) for name in ("s", "b")]
    with LiveServer(settings[0]) as server, LiveServer(settings[1]) as baseline:
        yield server, baseline


def test_bench_server_measures_both_servers_interleaved_and_writes_json(servers, tmp_path, capsys):
    server, baseline = servers
    out = tmp_path / "out.json"
    code = main(["bench", "server", "--url", server.url, "--baseline-url", baseline.url,
                 "--data", dataset(tmp_path / "data.json"), "--questions", "2", "--passages", "2",
                 "--concurrency", "2,1", "--max-tokens", "3", "--repeats", "2",
                 "--settle-s", "0", "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    summary = json.loads(lines[-1])
    assert json.loads(out.read_text()) == summary
    assert summary["bench"] == "server" and summary["concurrency"] == [1, 2] and summary["max_tokens"] == 3
    assert summary["servers"]["server"]["url"] == server.url and summary["servers"]["baseline"]["ingest_s"] > 0
    for role in ("server", "baseline"):
        rows = summary["results"][role]
        assert [row["clients"] for row in rows] == [1, 2]
        for row in rows:
            assert set(row) == LEVEL_KEYS
            assert row["num_requests"] == 2 * row["clients"] and row["num_errors"] == 0  # 2 repeats
            assert 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"] and row["itl_p50_ms"] <= row["itl_p95_ms"]
            assert row["itl_p95_ms"] <= row["itl_max_ms"] and len(row["wall_s_rounds"]) == row["num_rounds"]
            assert 0 < row["completion_tokens"] <= 2 * 3 * row["clients"] and row["tokens_per_s"] > 0
            assert row["requests_per_s"] == pytest.approx(statistics.median(row["clients"] / w
                                                                            for w in row["wall_s_rounds"]))
            assert row["mean_prompt_tokens"] > 40  # the question's 2 passages are in its prompt
    # the ratios are the rows' own figures divided
    results = {role: {row["clients"]: row for row in rows} for role, rows in summary["results"].items()}
    for row in summary["ratios"]:
        assert set(row) == RATIO_KEYS
        mine, base = results["server"][row["clients"]], results["baseline"][row["clients"]]
        assert row["ttft_p50_vs_baseline"] == pytest.approx(mine["ttft_p50_ms"] / base["ttft_p50_ms"])
        assert row["ttft_p95_vs_baseline"] == pytest.approx(mine["ttft_p95_ms"] / base["ttft_p95_ms"])
        assert row["tokens_per_s_vs_one_client"] == pytest.approx(mine["tokens_per_s"]
                                                                  / results["server"][1]["tokens_per_s"])
        assert row["baseline_tokens_per_s_vs_one_client"] == pytest.approx(base["tokens_per_s"]
                                                                           / results["baseline"][1]["tokens_per_s"])
    assert {check["clients"] for check in summary["targets"]} == {1, 2}
    # interleaved: each level runs on both servers back to back, who goes first alternating from level to
    # level and, for a level, from repeat to repeat
    chat_runs = [(s["clients"], s["server"]) for s in summary["schedule"]]
    assert chat_runs == [(1, "server"), (1, "baseline"), (2, "baseline"), (2, "server"),
                         (1, "baseline"), (1, "server"), (2, "server"), (2, "baseline")]
    table = "\n".join(lines[:-1])
    assert "TTFT p50 vs base" in table and "baseline" in table


def test_bench_server_without_baseline_and_bad_arguments(servers, tmp_path, capsys):
    server, _ = servers
    data = dataset(tmp_path / "data.json")
    assert main(["bench", "server", "--url", server.url, "--data", data, "--questions", "2", "--passages", "2",
                 "--concurrency", "1", "--max-tokens", "2", "--repeats", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["results"]) == {"server"} and summary["results"]["server"][0]["num_requests"] == 2
    assert summary["ratios"][0]["ttft_p50_vs_baseline"] is None and summary["targets"] == []
    assert "uploads" not in summary
    assert main(["bench", "server", "--url", server.url, "--data", data, "--concurrency", "1,4",
                 "--questions", "2"]) == 2
    assert "each client asks its own" in capsys.readouterr().err
    assert main(["bench", "server", "--serve", "--baseline-url", server.url, "--data", data]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "server", "--concurrency", "0,2"])


def answer(question_s: float, token_s: tuple[float, ...], end_s: float, **timings: float) -> StreamedAnswer:
    done = {"mode": "blend", "usage": {"prompt_tokens": 100, "completion_tokens": len(token_s)}, "timings": timings}
    return StreamedAnswer(question_s, token_s, end_s, "x" * len(token_s), done)


def test_level_statistics_and_ratios_on_known_answers():
    # two rounds of 2 clients: TTFTs 100, 300, 200, 400 ms; gaps 50, 100 | 50 | 20, 30 | 40 ms
    one = Round(2, 1.0, (Chat(0, answer(0.0, (0.1, 0.15, 0.25), 0.3, queue_ms=10.0)),
                         Chat(1, answer(0.0, (0.3, 0.35), 0.4, queue_ms=30.0))))
    two = Round(2, 0.5, (Chat(0, answer(1.0, (1.2, 1.22, 1.25), 1.3)),
                         Chat(1, answer(1.0, (1.4, 1.44), 1.5)), Chat(0, None, "QueryFailed: queue full")))
    row = level_stats([one, two])
    assert row["num_requests"] == 5 and row["num_errors"] == 1 and row["errors"] == ["QueryFailed: queue full"]
    assert row["ttft_p50_ms"] == pytest.approx(250) and row["ttft_p95_ms"] == pytest.approx(385)
    assert row["itl_p50_ms"] == pytest.approx(45) and row["itl_p95_ms"] == pytest.approx(87.5)
    assert row["queue_p50_ms"] == pytest.approx(20)  # only the answers that report a queue wait
    # 5 tokens in 1 s, 5 in 0.5 s: median of 5 and 10 tok/s; requests 2/1 s and 2/0.5 s
    assert row["tokens_per_s"] == pytest.approx(7.5) and row["requests_per_s"] == pytest.approx(3.0)
    assert row["completion_tokens"] == 10 and row["mean_prompt_tokens"] == 100 and row["modes"] == {"blend": 4}
    lone = level_stats([Round(1, 1.0, (Chat(0, answer(0.0, (0.1, 0.2), 0.2)),))])
    assert lone["queue_p50_ms"] is None and lone["tokens_per_s"] == 2.0
    results = {"server": [lone, row], "baseline": [lone, {**row, "ttft_p50_ms": 500.0, "tokens_per_s": 2.5}]}
    ratios = {r["clients"]: r for r in ratio_rows(results)}
    assert ratios[1]["ttft_p50_vs_baseline"] == 1.0 and ratios[2]["ttft_p50_vs_baseline"] == pytest.approx(0.5)
    assert ratios[2]["tokens_per_s_vs_one_client"] == pytest.approx(3.75)
    assert ratios[2]["baseline_tokens_per_s_vs_one_client"] == pytest.approx(1.25)
    assert ratios[2]["tokens_per_s_vs_baseline"] == pytest.approx(3.0)
    checks = target_checks({"ratios": ratio_rows(results)})
    met = {(c["name"], c["clients"]): c["is_met"] for c in checks}
    assert met[("aggregate tok/s vs one client's", 2)] and met[("ttft p50 vs baseline", 2)]
    assert not met[("ttft p95 vs baseline", 2)] and met[("ttft p50 vs baseline", 1)]


@pytest.mark.slow
def test_bench_server_serve_starts_both_servers_and_stops_them(tmp_path, capsys):
    """--serve: `ragblend serve` twice in child processes (the baseline with max_running=1), then stopped.
    Slow for the two servers' start-up (each imports torch and loads its model and embedder): 1.5 min on
    2 busy cores, most of it start-up."""
    import httpx

    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {json.dumps(TINY_MODEL)}\n")
    code = main(["bench", "server", "--serve", "--config", str(config), "--data", dataset(tmp_path / "data.json"),
                 "--questions", "2", "--passages", "2", "--concurrency", "1,2", "--max-tokens", "3"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    servers = summary["servers"]
    assert servers["baseline"]["env"] == {"RAGBLEND_SCHEDULER__MAX_RUNNING": "1"} and servers["server"]["env"] == {}
    assert servers["server"]["model"] == servers["baseline"]["model"] == "random"
    for role in ("server", "baseline"):
        assert [row["num_requests"] for row in summary["results"][role]] == [1, 2]
    assert summary["ratios"][1]["ttft_p50_vs_baseline"] > 0
    for info in servers.values():  # stopped
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{info['url']}/healthz", timeout=2)


def test_the_baseline_environment_of_serve():
    assert server_bench.baseline_environment(None) == {"RAGBLEND_SCHEDULER__MAX_RUNNING": "1"}  # one request at a time
    assert server_bench.baseline_environment(["RAGBLEND_SCHEDULER__MAX_DECODE_STALL_MS=0", "A=b=c"]) == {
        "RAGBLEND_SCHEDULER__MAX_DECODE_STALL_MS": "0", "A": "b=c"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        server_bench.baseline_environment(["RAGBLEND_SCHEDULER__MAX_RUNNING"])


def test_server_modes_throughput_alternates_full_and_blend_and_divides_their_rounds(servers, tmp_path, capsys):
    """`bench server-modes --modes ""`: the throughput rounds alone (the paper's row: N clients all in full
    against all in blend, alternated), each client its own question, answers max_tokens long."""
    server, _ = servers
    data = dataset(tmp_path / "data.json")
    assert main(["bench", "server-modes", "--url", server.url, "--data", data, "--questions", "3", "--passages", "2",
                 "--modes", "", "--concurrency", "2", "--throughput-rounds", "3", "--max-tokens", "3",
                 "--out", str(tmp_path / "tp.json")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["results"] == {} and summary["blend_ttft_speedup_vs_full"] is None
    throughput = summary["throughput"]
    assert throughput["clients"] == 2 and throughput["rounds"] == 3 and list(throughput["modes"]) == ["full", "blend"]
    assert [(s["round"], s["mode"]) for s in throughput["schedule"]] == [
        (0, "full"), (0, "blend"), (1, "blend"), (1, "full"), (2, "full"), (2, "blend")]
    # each round's clients ask distinct questions, the same in both modes of a round
    for first, second in zip(throughput["schedule"][::2], throughput["schedule"][1::2]):
        assert first["questions"] == second["questions"] and len(set(first["questions"])) == 2
    for mode, row in throughput["modes"].items():
        assert row["num_requests"] == 3 * 2 and row["num_errors"] == 0 and row["modes"] == {mode: 6}
        assert row["completion_tokens"] == 3 * 2 * 3  # ignore_eos: every answer max_tokens long
        rounds = row["requests_per_s_rounds"]
        assert rounds == pytest.approx([2 / wall for wall in row["wall_s_rounds"]])
        assert row["requests_per_s"] == pytest.approx(statistics.median(rounds))
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p95_ms"]
    full, blend = throughput["modes"]["full"], throughput["modes"]["blend"]
    ratios = throughput["ratios"]["blend/full"]
    per_round = [b / f for b, f in zip(blend["requests_per_s_rounds"], full["requests_per_s_rounds"])]
    assert ratios["requests_per_s"]["values"] == pytest.approx(per_round)
    assert ratios["requests_per_s"]["median"] == pytest.approx(statistics.median(per_round))
    assert ratios["ttft_p50"] == pytest.approx(blend["ttft_p50_ms"] / full["ttft_p50_ms"])
    assert ratios["ttft_p95"] == pytest.approx(blend["ttft_p95_ms"] / full["ttft_p95_ms"])
    assert "blend/full: req/s" in "\n".join(lines[:-1])
    # what each throughput request asks for (a random model seldom stops early, so the rounds cannot show it)
    from bench.harness.data import Question
    from bench.serving.modes import round_args

    body = server_bench.request_body(Question("q?", (), ("p",)), 0, round_args("blend", 5))
    assert body["ignore_eos"] is True and body["mode"] == "blend" and body["max_tokens"] == 5
    assert body["prefix_cache"] is False  # each round's answers prefill: the same questions come again
    # without ignore_eos (natural answers, each ending at the model's end of text) the field is not sent at
    # all: a revision whose API predates it refuses it (compare)
    natural = round_args("blend", 5, ignore_eos=False)
    assert "ignore_eos" not in server_bench.request_body(Question("q?", (), ("p",)), 0, natural)
    assert throughput["answers"] == "fixed" and throughput["ignore_eos"] is True
    assert full["completion_tokens_per_answer"] == {"mean": 3, "median": 3, "max": 3}
    # natural answers end to end: their lengths reported
    assert main(["bench", "server-modes", "--url", server.url, "--data", data, "--questions", "2", "--passages", "2",
                 "--modes", "", "--concurrency", "2", "--throughput-rounds", "1", "--max-tokens", "4",
                 "--throughput-answers", "natural"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    natural_run = json.loads(out[-1])["throughput"]
    assert natural_run["answers"] == "natural" and natural_run["ignore_eos"] is False
    assert "answers ending at end of text (at most 4 tokens)" in "\n".join(out[:-1])
    for row in natural_run["modes"].values():
        lengths = row["completion_tokens_per_answer"]
        assert lengths["mean"] == pytest.approx(row["completion_tokens"] / 2) and 1 <= lengths["max"] <= 4
    # more clients than questions: refused (each client asks its own)
    assert main(["bench", "server-modes", "--url", server.url, "--data", data, "--questions", "2",
                 "--concurrency", "3"]) == 2
    assert "each client asks its own" in capsys.readouterr().err
