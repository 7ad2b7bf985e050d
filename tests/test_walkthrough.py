"""The knowledge-base steps of docs/getting-started.md (section 5) run as written: each line of its bash
block in bash, `ragblend serve` a real process, then a check that the key the steps made reads its own
collection and nothing of another. The only changes are through the settings' own environment
variables: a tiny random model (not SmolLM2) and a free port (the CLI's `RAGBLEND_URL`, and the page's
`localhost:8000` read as that port). Before issue 62 these steps gave the server no key (they set only
the CLI's `RAGBLEND_API_KEY`), so the scoped key they made protected nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.readiness import free_port

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "getting-started.md"
TOKEN = re.compile(r"rbk_[0-9a-f]{12}_[A-Za-z0-9_-]{43}")
LEAVE = "Every employee gets 31 days of annual leave, and 5 more after ten years."
PAYROLL = "Payroll runs on the 25th; the finance team approves every bonus."


def walkthrough() -> list[str]:
    """The lines of section 5's bash block, comments and blank lines left out."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text[text.index("## 5. Knowledge bases"):]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None, "getting-started.md section 5 has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


def read_env(path: Path) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in path.read_bytes().decode().split("\0") if "=" in item)
    return dict(pairs)


@pytest.fixture
def steps(tmp_path):
    """Runs lines of the guide in bash, one after another, each in the environment the ones before left
    (their `export`s); a `ragblend serve` line starts the server, which is stopped at the end."""
    port = free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("RAGBLEND_")}
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # this venv's `ragblend`
        "PYTHONPATH": f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT),
        "HF_HUB_OFFLINE": "1", "RAGBLEND_MODEL__NAME": "random:tiny-llama", "RAGBLEND_MODEL__DEVICE": "cpu",
        "RAGBLEND_GENERATION__MAX_TOKENS": "2", "RAGBLEND_DATA_DIR": str(tmp_path / "data"),
        "RAGBLEND_SERVER__PORT": str(port), "RAGBLEND_URL": f"http://127.0.0.1:{port}",
    })
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "leave.md").write_text(f"# Annual leave\n\n{LEAVE}\n")
    servers: list[subprocess.Popen] = []
    outputs: list[str] = []

    def run(line: str) -> subprocess.CompletedProcess:
        line = line.replace("localhost:8000", f"127.0.0.1:{port}")
        tokens = TOKEN.findall("\n".join(outputs))
        if "rbk_..." in line:
            assert tokens, "no step printed a key before the line that uses one"
            line = line.replace("rbk_...", tokens[-1])
        if re.match(r"\s*ragblend serve\b", line):
            command = line.split("#")[0].strip().removesuffix("&").strip()
            log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115: the server's, closed with it
            servers.append(subprocess.Popen(["bash", "-c", f"exec {command}"], env=env, cwd=tmp_path,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
            return subprocess.CompletedProcess(line, 0, "", "")
        env_file = tmp_path / "env"
        script = f"{line}\nstatus=$?\nenv -0 > {env_file}\nexit $status\n"
        done = subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{line}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}\n{server_log()}"
        env.clear()
        env.update(read_env(env_file))
        outputs.append(done.stdout)
        return done

    def server_log() -> str:
        path = tmp_path / "serve.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    run.env, run.port = env, port
    try:
        yield run
    finally:
        for server in servers:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)  # its own session: the server and nothing else
                try:
                    server.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait(10)


def test_the_getting_started_knowledge_base_steps_work_as_written(steps):
    lines = walkthrough()
    assert any("ragblend serve" in line for line in lines) and any("keys create" in line for line in lines)
    results = [steps(line) for line in lines]
    url, env = f"http://127.0.0.1:{steps.port}", steps.env
    server_key = env["RAGBLEND_SERVER__API_KEY"]
    [token] = {t for r in results for t in TOKEN.findall(r.stdout)}
    asked = results[-1].stdout
    assert "Sources:" in asked and "hr/" in asked, asked  # the last step: the key's own collection answered
    with httpx.Client(base_url=url, timeout=120) as http:
        # the server has its key (the steps gave it the right variable): nothing without one
        assert http.get("/v1/collections").status_code == 401
        admin, scoped = {"Authorization": f"Bearer {server_key}"}, {"Authorization": f"Bearer {token}"}
        assert http.post("/v1/collections", headers=admin, json={"name": "finance"}).status_code == 201
        assert http.post("/v1/documents", headers=admin, json={
            "collection": "finance", "documents": [{"id": "payroll", "text": PAYROLL}]}).status_code == 201
        # the key made by the steps reads its own collection, and another reads as one that does not exist
        assert [c["name"] for c in http.get("/v1/collections", headers=scoped).json()["collections"]] == ["hr"]
        gone = http.get("/v1/documents", headers=scoped, params={"collection": "finance"})
        assert gone.status_code == 404 and gone.json()["error"]["message"] == "collection not found: finance"
        asked_anyway = http.post("/v1/query", headers=scoped, json={"question": "When does payroll run?", "top_k": 5})
        assert {s["collection"] for s in asked_anyway.json()["sources"]} <= {"hr"}
        assert http.post("/v1/keys", headers=scoped, json={"role": "read", "collections": ["finance"]}).status_code == 403
    # and so does the CLI with that key
    cli = subprocess.run(["bash", "-c", 'ragblend ask "When does payroll run?" --collection finance'],
                         env={**env, "RAGBLEND_API_KEY": token}, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 1 and "collection not found: finance" in cli.stderr, (cli.stdout, cli.stderr)
