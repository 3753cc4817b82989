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


@contextlib.contextmanager
def throwaway_server() -> Iterator[str]:
    """Start a cluster; yield its admin URL (postgresql+psycopg://...); stop and remove it."""
    bin_dir = binaries()
    if bin_dir is None:
        raise RuntimeError("no PostgreSQL binaries (initdb) on this machine")
    prefix = _as_owner()
    folder = Path(tempfile.mkdtemp(prefix="batchrun-pg-"))
    if prefix:
        shutil.chown(folder, "postgres")
    data, port = folder / "data", _free_port()
    try:
        initdb = [str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"]
        subprocess.run(
            [*prefix, *initdb, "--no-sync", "-E", "UTF8"], check=True, capture_output=True
        )
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} -c fsync=off"
        pg_ctl = [str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options]
        log = ["-l", str(folder / "server.log")]
        subprocess.run([*prefix, *pg_ctl, *log, "-w", "start"], check=True, capture_output=True)
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*prefix, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            capture_output=True,
        )
        shutil.rmtree(folder, ignore_errors=True)


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
