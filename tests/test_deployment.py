"""docker-compose.yml and deploy/nginx.conf, checked without a container daemon: `docker compose config`
(or Debian's `docker-compose config`, which .ci/run installs: this machine's docker CLI has no compose
plugin) and the file's structure with PyYAML. The topology itself runs for real, without docker, in
tests/test_replicas.py (Postgres, Redis, two replicas, nginx with deploy/nginx.conf)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
REPLICAS = ("ragblend-a", "ragblend-b")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def compose_command() -> list[str] | None:
    """A compose implementation that runs here: the docker CLI's plugin, else Debian's `docker-compose`
    (which .ci/run installs). `config` only parses, interpolates and validates: no daemon needed."""
    if shutil.which("docker") is not None:
        done = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") is not None else None


COMPOSE = compose_command()
needs_compose = pytest.mark.skipif(COMPOSE is None, reason="neither `docker compose` nor `docker-compose` here "
                                   "(.ci/run installs Debian's docker-compose)")


def compose_config(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*COMPOSE, "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin:/usr/local/bin", **env},
                          timeout=60)


@needs_compose
def test_docker_compose_config_accepts_the_file():
    done = compose_config({"RAGBLEND_API_KEY": "k", "RAGBLEND_DB_PASSWORD": "p"})
    assert done.returncode == 0, done.stderr


@needs_compose
@pytest.mark.parametrize("missing", ["RAGBLEND_API_KEY", "RAGBLEND_DB_PASSWORD"])
def test_docker_compose_config_refuses_a_missing_secret(missing):
    env = {"RAGBLEND_API_KEY": "k", "RAGBLEND_DB_PASSWORD": "p"}
    del env[missing]
    done = compose_config(env)
    assert done.returncode != 0 and missing in done.stderr


def test_the_image_copies_every_package_the_project_installs():
    """`pip install .` in the Dockerfile installs what was copied: a package pyproject lists but the
    Dockerfile leaves out is missing from the image (the server then fails to import)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {pattern.rstrip("*") for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (ROOT / "Dockerfile").read_text(), re.M))
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"


def test_compose_topology_is_complete(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "redis", *REPLICAS, "nginx"}
    for name, service in services.items():
        assert service["healthcheck"]["test"], f"{name} has no health check"
        assert service["restart"] == "unless-stopped"
    urls = set()
    for name in REPLICAS:
        replica = services[name]
        assert replica["build"] == "."
        assert {dep: c["condition"] for dep, c in replica["depends_on"].items()} == {
            "postgres": "service_healthy", "redis": "service_healthy"}
        env = replica["environment"]
        assert env["RAGBLEND_DATABASE__URL"].startswith("postgresql://ragblend:")
        assert "@postgres:5432/ragblend" in env["RAGBLEND_DATABASE__URL"]
        assert env["RAGBLEND_STORE__REDIS_URL"] == "redis://redis:6379/0"
        assert ":?" in env["RAGBLEND_SERVER__API_KEY"]
        urls.add(env["RAGBLEND_DATABASE__URL"])
        assert "/readyz" in " ".join(replica["healthcheck"]["test"])
    assert len(urls) == 1  # one shared store
    data_volumes = [v.split(":")[0] for name in REPLICAS for v in services[name]["volumes"]]
    assert len(set(data_volumes)) == 2 and set(data_volumes) <= set(compose["volumes"])  # a data dir each
    assert ":?" in services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    nginx = services["nginx"]
    assert {dep: c["condition"] for dep, c in nginx["depends_on"].items()} == dict.fromkeys(REPLICAS, "service_healthy")
    assert "./deploy/nginx.conf:/etc/nginx/nginx.conf:ro" in nginx["volumes"]


def test_nginx_config_balances_both_replicas_and_streams_unbuffered(compose):
    conf = (ROOT / "deploy" / "nginx.conf").read_text()
    assert re.findall(r"server (ragblend-\w):8000", conf) == list(REPLICAS)
    for directive in ("proxy_buffering off;", "proxy_http_version 1.1;", "listen 8000;"):
        assert directive in conf
    assert "8000:8000" in compose["services"]["nginx"]["ports"][0]
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():  # nginx's own parser, where it is installed
        try:
            from tests.nginx_server import find_nginx, loopback_config
        except ImportError:
            from nginx_server import find_nginx, loopback_config
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "nginx.conf"
            path.write_text(loopback_config(["127.0.0.1:1", "127.0.0.1:2"], 8, Path(tmp)))
            directives = f"pid {tmp}/pid; error_log {tmp}/e.log;"
            done = subprocess.run([find_nginx(), "-t", "-p", tmp, "-c", str(path), "-g", directives],
                                  capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
