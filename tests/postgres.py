"""A throwaway PostgreSQL server for the tests: Debian's PostgreSQL 15 binaries, a cluster made
with initdb in a temporary folder (under the `postgres` user when the tests run as root), on a
free 127.0.0.1 port, gone when the tests end. Never a mock: the ledger's SQL runs on the real
server. BATCHRUN_TEST_POSTGRES_URL points the tests at a server of your own instead."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg


def binaries() -> Path | None:
    """The folder of initdb/pg_ctl: on PATH, or Debian's /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(versions[-1]).parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_owner() -> list[str]:
    """Run the server's programs as `postgres` when we are root (it refuses root)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser") is None:
        raise RuntimeError("running as root, and no runuser to start PostgreSQL as postgres")
    return ["runuser", "-u", "postgres", "--"]


class Cluster:
    """A cluster in a temporary folder on a free port: made, started, stopped (a restart is a
    stop and a start, to test what a run does while its database is away), removed."""

    def __init__(self) -> None:
        bin_dir = binaries()
        if bin_dir is None:
            raise RuntimeError("no PostgreSQL binaries (initdb) on this machine")
        self.bin_dir, self.prefix = bin_dir, _as_owner()
        self.folder = Path(tempfile.mkdtemp(prefix="batchrun-pg-"))
        if self.prefix:
            shutil.chown(self.folder, "postgres")
        self.data, self.port = self.folder / "data", _free_port()
        initdb = [str(bin_dir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres"]
        self._run(*initdb, "--no-sync", "-E", "UTF8")
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *command: str) -> None:
        subprocess.run([*self.prefix, *command], check=True, capture_output=True)

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off"
        pg_ctl = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-o", options]
        self._run(*pg_ctl, "-l", str(self.folder / "server.log"), "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """fast: sessions are ended, as a restart by an operator does; immediate: a crash."""
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def throwaway_cluster() -> Iterator[Cluster]:
    """A started cluster, removed afterwards."""
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.remove()


@contextlib.contextmanager
def throwaway_server() -> Iterator[str]:
    """Start a cluster; yield its admin URL (postgresql+psycopg://...); stop and remove it."""
    with throwaway_cluster() as cluster:
        yield cluster.url


@contextlib.contextmanager
def fresh_database(admin_url: str) -> Iterator[str]:
    """A new empty database on the server for one test; dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    plain = admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        deadline = time.monotonic() + 10
        with psycopg.connect(plain, autocommit=True) as conn:
            while True:
                try:
                    conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                    break
                except psycopg.errors.ObjectInUse:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
