"""A real, temporary Postgres cluster for the shared-store tests: initdb into a fresh directory, the
server on 127.0.0.1 (a free port) and a unix socket in that directory, no fsync (a test cluster),
stopped and removed by the caller. Postgres refuses to run as root, so as root the cluster belongs
to the `postgres` user (made by Debian's package) or else `nobody`."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

DATABASE = "ragblend"
USER = "ragblend"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_bin_dir() -> Path | None:
    """The directory of pg_ctl/initdb/postgres: on PATH, or Debian's /usr/lib/postgresql/<version>/bin."""
    on_path = shutil.which("pg_ctl")
    if on_path is not None and shutil.which("initdb") is not None:
        return Path(on_path).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    return Path(candidates[-1]).parent if candidates else None


def _run_as() -> str | None:
    """The unprivileged user to run the cluster as (None: we are not root, run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' user exists")


class PostgresServer:
    """`start()` / `stop()` / `restart()`: the same port and data across restarts."""

    def __init__(self) -> None:
        bin_dir = find_bin_dir()
        if bin_dir is None:
            raise FileNotFoundError("no Postgres binaries (CI installs them from Debian: apt-get install postgresql)")
        self.bin_dir, self.user, self.port = bin_dir, _run_as(), free_port()
        self.root = Path(tempfile.mkdtemp(prefix="ragblend-pg-"))  # /tmp: reachable by the cluster's user
        self.data_dir, self.log_path = self.root / "data", self.root / "server.log"
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data_dir), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-sync")
        self._is_running = False

    @property
    def url(self) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{DATABASE}"

    def _run(self, program: str, *args: str, timeout_s: float = 60) -> str:
        done = subprocess.run([str(self.bin_dir / program), *args], user=self.user, cwd=self.root,
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{program} failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
        return done.stdout

    def start(self) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root}"
                   " -c fsync=off -c full_page_writes=off -c synchronous_commit=off -c max_connections=100")
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-o", options, "-w", "-t", "60",
                  "start")
        self._is_running = True
        import psycopg

        with psycopg.connect(f"postgresql://{USER}@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
                conn.execute(f"CREATE DATABASE {DATABASE}")

    def new_database(self) -> str:
        """The URL of a fresh, empty database on this cluster (one per test: no state leaks between them)."""
        import psycopg

        self._num_databases = getattr(self, "_num_databases", 0) + 1
        name = f"test_{self._num_databases}"
        with psycopg.connect(f"postgresql://{USER}@127.0.0.1:{self.port}/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name}")
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{name}"

    def stop(self, mode: str = "fast") -> None:
        if self._is_running:
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "-t", "60", "stop")
            self._is_running = False

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        try:
            self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""


def start_or_skip() -> PostgresServer:
    """A started cluster, or the calling test skipped with the reason: only when no binary exists."""
    import pytest  # only tests call this

    try:
        server = PostgresServer()
    except FileNotFoundError as exc:
        pytest.skip(f"no Postgres to test against: {exc}")
    try:
        server.start()
    except BaseException:
        server.close()
        raise
    return server
