"""Two (or more) real `ragblend serve` processes sharing one Postgres document store and one
redis-server KV tier, each with its own data directory (FAISS index) on a loopback port: the
topology of docs/deployment.md#replicas. Children are forked from the crash harness's fork server
(heavy imports done once)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

try:
    from tests.crash_harness import ServerProcess, fork_context
except ImportError:  # tests/ is not a package: pytest put it on sys.path itself
    from crash_harness import ServerProcess, fork_context

API_KEY = "replica-test-key"  # required, as in docker-compose.yml
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
REPLICA_CONFIG = """\
server: {{api_key: "%s"}}
model: {{name: "random:tiny-llama", device: cpu}}
retrieval: {{chunk_tokens: 32, chunk_overlap: 0}}
store:
  max_memory_bytes: 0
  disk_enabled: false
  write_tiers: [redis]             # KV lives in the shared tier only: a hit on B is A's entry
  redis_url: "{redis_url}"
database:
  url: "{database_url}"
  timeout_s: {timeout_s}
  poll_s: {poll_s}
""" % API_KEY


def write_config(path: Path, redis_url: str, database_url: str, poll_s: float = 30.0, timeout_s: float = 2.0) -> Path:
    """`poll_s` 30 by default: a change seen within 1 s was woken by NOTIFY, not by the fallback poll."""
    path.write_text(REPLICA_CONFIG.format(redis_url=redis_url, database_url=database_url, poll_s=poll_s,
                                          timeout_s=timeout_s))
    return path


@dataclass
class Replica:
    name: str
    server: ServerProcess
    data_dir: Path

    @property
    def url(self) -> str:
        return self.server.url


def start_replicas(ctx, root: Path, config: Path, names: tuple[str, ...] = ("a", "b")) -> list[Replica]:
    replicas = []
    try:
        for name in names:
            data_dir = root / name
            replica = Replica(name, ServerProcess(ctx, data_dir, config), data_dir)
            replica.server.start()
            replicas.append(replica)
    except BaseException:
        stop_all(replicas)
        raise
    return replicas


def restart(ctx, replica: Replica, config: Path) -> Replica:
    replica.server = ServerProcess(ctx, replica.data_dir, config)
    replica.server.start()
    return replica


def stop_all(replicas: list[Replica]) -> None:
    for replica in replicas:
        try:
            replica.server.stop()
        except Exception:  # keep stopping the rest
            pass


def until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> float:
    """Seconds until `predicate()` held; raises AssertionError after `timeout_s`."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(poll_s)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels` (0 when none)."""
    text = httpx.get(f"{url}/metrics", headers=HEADERS, timeout=30).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if match is None:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def ask(url: str, question: str, top_k: int = 3, timeout_s: float = 60, **extra) -> dict:
    response = httpx.post(f"{url}/v1/query", json={"question": question, "top_k": top_k, "max_tokens": 1, **extra},
                          headers=HEADERS, timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def listed(url: str) -> set[str]:
    response = httpx.get(f"{url}/v1/documents", params={"limit": 1000}, headers=HEADERS, timeout=30)
    response.raise_for_status()
    return {d["id"] for d in response.json()["documents"]}


def ingest(url: str, doc_id: str, text: str, timeout_s: float = 120) -> dict:
    response = httpx.post(f"{url}/v1/documents", json={"documents": [{"id": doc_id, "text": text}]},
                          headers=HEADERS, timeout=timeout_s)
    assert response.status_code in (200, 201), response.text
    return response.json()["documents"][0]


__all__ = ["HEADERS", "Replica", "ask", "fork_context", "ingest", "listed", "metric", "restart", "start_replicas",
           "stop_all", "until", "write_config"]
