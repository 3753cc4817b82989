"""Issue 11's judge: whole jobs under --concurrency auto against the best fixed level, per shape.

For each server shape the same job goes through the real CLI (`batchrun submit` in a
subprocess, a fresh --home per run, the server restarted per run so no state carries over)
under fixed levels 1, 2, 4, 8, ... and under `--concurrency auto`. The figure is the whole
job's wall time, ramp included (the run's own `elapsed_s` from the job log, which leaves out
process start and ingest, the same for every setting).

    python benchmarks/concurrency_matrix.py                    # every shape, median of 3
    python benchmarks/concurrency_matrix.py --quick --shapes knee8,gate429
    python benchmarks/concurrency_matrix.py --list

How the time is spent (a 2-core machine runs the client and the server together):

- Round 1: auto, then fixed levels upwards from 1. The sweep stops after a level whose job
  failed items or had >= 10% of its requests refused (the server refuses), after two levels in
  a row that are not 5% faster than the best so far (it stopped improving), or at
  --max-level. A fixed run that will clearly take more than --slow-factor (2) times the best
  so far is stopped early, from its throughput and its latency so far (Little's law: items /
  level x latency), and its time shown as a projection (~).
- Rounds 2 and 3: only auto and the contenders (levels within --slow-factor of the best,
  that failed nothing) again, in reversed, then the first order, so a drift in the machine's
  load does not favour one side. Each setting's figure is its median.

Reported per shape: auto's share of the best fixed level (best fixed median / auto median, so
1.0 is as fast and above 1.0 is faster), requests refused (429/503, counted from the job
log's attempt lines) as a share of all auto's attempts, failed items (auto's worst run), and
auto's final limit in each run (the log's `run_stopped` limit). Targets: share >= 0.9 on
every shape and a geometric mean >= 0.95; behind the 429 gate < 1% of auto's requests
refused; on the one-at-a-time server no failed item. Exit status 1 when a target is missed,
130 when interrupted (Ctrl-C or kill: servers and CLIs are stopped, the runs so far tabled).

Shapes 1-8 are `benchmarks/shape_server.py` (independent of batchrun; see its docstring);
9 is llama.cpp's C++ `llama-server -np 8` ($BATCHRUN_LLAMA_SERVER, else the cache that
`.ci/build-llama-server` builds into), 10 is `python -m llama_cpp.server` with its default
of cutting a running stream when the next request arrives; both load the tiny test model
(the integration tests' copy or $BATCHRUN_TEST_MODEL) and are skipped, saying why, when
missing. Every run's row goes to a JSON file (--json), rewritten after each run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests' helpers, server presets

from benchmarks.shape_server import SHAPES as SERVER_SHAPES
from tests.integration.helpers import cli_command, free_port

REPO = Path(__file__).resolve().parents[1]
SHAPE_SERVER = REPO / "benchmarks" / "shape_server.py"
LLAMA_VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
REFUSED = (429, 503)
POLL_S = 0.5
SERVER_START_S = 60.0
STATUS_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Shape:
    """A server to judge against, and the job sent to it."""

    name: str
    doc: str
    kind: str  # "shape" (shape_server.py), "llama-server" or "llama-cpp-python"
    items: int = 500
    max_tokens: int = 64
    backend: str = "custom"
    first_limit_s: float = 300.0  # the longest any run may take before a reference time exists
    refused_target: bool = False  # < 1% of auto's requests refused
    no_failed_target: bool = False  # no failed item under auto
    flags: str = ""  # more of the server's own flags (llama-server's --metrics, say)


# What the matrix adds to the shape server's presets (shapes 1-8, in its order).
OPTIONS: dict[str, dict[str, Any]] = {
    "gate429": {"refused_target": True},
    "long": {"first_limit_s": 900.0},
}
SHAPES = {
    name: Shape(name, preset.doc, "shape", **OPTIONS.get(name, {}))
    for name, preset in SERVER_SHAPES.items()
}
SHAPES["llama-np8"] = Shape(
    "llama-np8",
    "llama.cpp's C++ llama-server -np 8 (continuous batching, 8 slots), tiny model",
    "llama-server",
    max_tokens=48,
    backend="llamacpp",
)
SHAPES["llama-one"] = Shape(
    "llama-one",
    "python -m llama_cpp.server: one request at a time, and the next request cuts the "
    "running stream (its default)",
    "llama-cpp-python",
    max_tokens=48,
    backend="llamacpp",
    first_limit_s=600.0,
    no_failed_target=True,
)


@dataclass
class Run:
    """One job run under one setting: the row written to the JSON file."""

    shape: str
    setting: str  # "auto" or a fixed level
    round: int
    items: int
    wall_s: float | None = None  # the run's elapsed_s; a projection when cut
    cut: bool = False  # stopped early as clearly slow (wall_s is then projected)
    process_s: float = 0.0  # the CLI process, start to exit
    exit_code: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    attempts: int = 0
    refused: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    final_limit: int | None = None
    limits: list[int] = field(default_factory=list)
    server_stats: dict[str, Any] | None = None
    note: str = ""

    @property
    def failed(self) -> int:
        return sum(self.counts.get(k, 0) for k in ("failed", "invalid", "rejected"))

    @property
    def finished(self) -> bool:
        """Every item got a final status, and the run was not cut short."""
        left = self.counts.get("pending", 0) + self.counts.get("running", 0)
        return not self.cut and self.wall_s is not None and not left and bool(self.counts)

    @property
    def refused_share(self) -> float:
        return self.refused / self.attempts if self.attempts else 0.0


# --- servers ---------------------------------------------------------------------------------


def find_model() -> Path | None:
    """The tiny test model shipped in tests/models (or $BATCHRUN_TEST_MODEL)."""
    path = Path(os.environ.get("BATCHRUN_TEST_MODEL") or REPO / "tests/models/stories260K.gguf")
    return path if path.exists() else None


def llama_server_binary() -> Path | None:
    """$BATCHRUN_LLAMA_SERVER, else where .ci/build-llama-server caches its build."""
    if os.environ.get("BATCHRUN_LLAMA_SERVER"):
        path = Path(os.environ["BATCHRUN_LLAMA_SERVER"])
    else:
        root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        cache = Path(os.environ.get("BATCHRUN_ENGINE_CACHE", f"{root}/batchrun"))
        path = cache / f"llama-server-{LLAMA_VERSION}" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing(shape: Shape) -> str | None:
    """Why this shape cannot run here, or None."""
    if shape.kind == "shape":
        return None
    if find_model() is None:
        return "the tiny model is not there (set BATCHRUN_TEST_MODEL)"
    if shape.kind == "llama-server" and llama_server_binary() is None:
        return (
            "no llama-server binary (set BATCHRUN_LLAMA_SERVER, or build it with "
            ".ci/build-llama-server)"
        )
    if shape.kind == "llama-cpp-python" and importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not importable (pip install -e '.[llamacpp]')"
    return None


def server_command(shape: Shape, port: int) -> list[str]:
    if shape.kind == "shape":
        return [sys.executable, str(SHAPE_SERVER), "--shape", shape.name, "--port", "0"]
    model = str(find_model())
    if shape.kind == "llama-server":
        # 8 slots of 512 tokens each (the tiny model's training context). One thread: with
        # its default (every core) its threads wait on each other at every step, and on 2
        # cores shared with the client a step then takes 100x longer (25 s for 48 tokens).
        flags = f"--host 127.0.0.1 --port {port} -np 8 -c 4096 -t 1 {shape.flags}"
        return [str(llama_server_binary()), "-m", model, *flags.split()]
    flags = f"--host 127.0.0.1 --port {port} --n_ctx 512"
    return [sys.executable, "-m", "llama_cpp.server", "--model", model, *flags.split()]


def stop(proc: subprocess.Popen[Any]) -> None:
    """End a child we started (and its own process group): politely, then for sure."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def wait_ready(url: str, proc: subprocess.Popen[Any], log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {tail(log)}")
        try:
            with urllib.request.urlopen(url + "/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"server not ready within {SERVER_START_S:g}s: {tail(log)}")


def shape_server_url(proc: subprocess.Popen[Any], log: Path) -> str:
    """The URL the shape server prints once it listens (it picks its own free port)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], SERVER_START_S)
    line = proc.stdout.readline().decode() if ready else ""
    if not line.startswith("serving "):
        raise RuntimeError(f"shape server did not start: {line!r} {tail(log)}")
    return line.split()[1]


@contextlib.contextmanager
def serve(shape: Shape, log: Path) -> Iterator[str]:
    """A fresh server for one run; always killed afterwards."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            server_command(shape, port),
            stdout=subprocess.PIPE if shape.kind == "shape" else out,
            stderr=out,
            start_new_session=True,
        )
    try:
        if shape.kind == "shape":
            url = shape_server_url(proc, log)
        else:
            url = f"http://127.0.0.1:{port}/v1"
        wait_ready(url, proc, log)
        yield url
    finally:
        stop(proc)


def server_stats(url: str) -> dict[str, Any] | None:
    """The shape server's own counts, to check the log's against; None for other servers."""
    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/stats", timeout=5) as resp:
            stats: dict[str, Any] = json.loads(resp.read())["stats"]
            return stats
    except (OSError, ValueError, KeyError):
        return None


def tail(path: Path, chars: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# --- one run ---------------------------------------------------------------------------------


class LogWatch:
    """Reads a job log as it grows: attempts, latencies, limits, the run's end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.events: list[dict[str, Any]] = []
        self.started_at: float | None = None  # this process's clock when run_started showed
        self.ok = 0
        self.latencies: list[float] = []
        self.ok_times: list[tuple[float, int]] = []  # (clock, ok so far), per poll

    def poll(self) -> None:
        now = time.monotonic()
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line being written waits for the next poll
        self.offset += end
        for line in data[:end].splitlines():
            with contextlib.suppress(ValueError):  # a torn line after a kill -9
                self.add(json.loads(line), now)
        if self.started_at is not None:
            self.ok_times.append((now, self.ok))

    def add(self, event: dict[str, Any], now: float) -> None:
        self.events.append(event)
        if event.get("event") == "run_started" and self.started_at is None:
            self.started_at = now
        elif event.get("event") == "attempt" and event.get("status") == "ok":
            self.ok += 1
            if event.get("latency_ms") is not None:
                self.latencies.append(float(event["latency_ms"]) / 1000)

    def elapsed(self) -> float:
        return time.monotonic() - self.started_at if self.started_at is not None else 0.0

    def too_slow(self, items: int, level: int, cut_at: float) -> float | None:
        """The run's projected time when it will clearly take longer than `cut_at`, else None.

        Two projections. From the first 3 answers, Little's law (items / level x the median
        latency), so that a level far too low (one 5 s request at a time) is known within
        seconds; but the first answers come from requests sent together, slower than later
        ones where requests contend (shared prefills), so it must pass `cut_at` by half
        again. Then the steady rate since the first answer, over the last few seconds (at
        least 2 s and a median latency, so that waves of answers average out).
        """
        if len(self.latencies) < 3:
            return None
        latency = statistics.median(self.latencies)
        if items / level * latency > 1.5 * cut_at:
            return items / level * latency
        answered = [(t, n) for t, n in self.ok_times if n > 0]
        if not answered:
            return None
        t2, n2 = answered[-1]
        t1, n1 = next((t, n) for t, n in answered if t >= t2 - max(3.0, 2 * latency))
        if t2 - t1 < max(2.0, latency) or n2 - n1 < 10:
            return None
        steady = self.elapsed() + (items - n2) * (t2 - t1) / (n2 - n1)
        return steady if steady > cut_at else None


@dataclass(frozen=True)
class Limits:
    """When to give up on a run: `cut_at` (projected time) for fixed levels, `hard` for all."""

    cut_at: float | None
    hard: float


def run_job(
    shape: Shape, url: str, setting: str, home: Path, inp: Path, limits: Limits, run: Run
) -> None:
    """Send the job through `batchrun submit` and fill `run` from its log and `status`."""
    cmd = cli_command(
        home,
        "submit",
        str(inp),
        "--job",
        "m",
        "--backend",
        shape.backend,
        "--base-url",
        url,
        "--concurrency",
        setting,
        "--max-tokens",
        str(shape.max_tokens),
        "--quiet",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHRUN_HOME", "BATCHRUN_LEDGER")}
    watch = LogWatch(home / "logs" / "m.log")
    started = time.monotonic()
    with (home / "cli.out").open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        run.cut, run.note = supervise(proc, watch, setting, limits, run)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    run.process_s = round(time.monotonic() - started, 3)
    run.exit_code = proc.returncode
    watch.poll()
    read_log(watch, run)
    run.counts = job_counts(home, env)
    if run.exit_code not in (0, 1) and not run.cut and not run.note:
        run.note = f"exit {run.exit_code}: {tail(home / 'cli.out', 300)!r}"


def supervise(
    proc: subprocess.Popen[Any], watch: LogWatch, setting: str, limits: Limits, run: Run
) -> tuple[bool, str]:
    """Wait for the CLI; (True, why) when it was stopped early, with run.wall_s projected."""
    level = None if setting == "auto" else int(setting)
    while True:
        try:
            proc.wait(timeout=POLL_S)
            return False, ""
        except subprocess.TimeoutExpired:
            pass
        watch.poll()
        elapsed = watch.elapsed()
        if elapsed > limits.hard:
            run.wall_s = round(elapsed, 3)
            return True, f"stopped at the hard limit {limits.hard:.0f}s"
        if level is None or limits.cut_at is None:
            continue
        projected = watch.too_slow(run.items, level, limits.cut_at)
        if elapsed > limits.cut_at or projected is not None:
            run.wall_s = round(max(elapsed, projected or 0.0), 3)
            return True, f"slow: cut after {elapsed:.1f}s (over {limits.cut_at:.1f}s)"


def read_log(watch: LogWatch, run: Run) -> None:
    """Attempts, refusals, error kinds, limits and the run's own elapsed time, from its log."""
    for event in watch.events:
        kind = event.get("event")
        if kind == "attempt":
            run.attempts += 1
            if event.get("status") != "ok":
                status = event.get("http_status")
                run.refused += status in REFUSED
                key = str(status or event.get("error_kind") or "error")
                run.errors[key] = run.errors.get(key, 0) + 1
        elif kind == "concurrency":
            run.limits.append(int(event["limit"]))
        elif kind == "run_stopped":
            run.final_limit = event.get("limit")
            if not run.cut:
                run.wall_s = float(event["elapsed_s"])
    if run.final_limit is None and run.limits:
        run.final_limit = run.limits[-1]


def job_counts(home: Path, env: dict[str, str]) -> dict[str, int]:
    """Item counts by status, from `batchrun status --json` (the operator's view)."""
    try:
        done = subprocess.run(
            cli_command(home, "status", "m", "--json"),
            capture_output=True,
            text=True,
            env=env,
            timeout=STATUS_TIMEOUT_S,
        )
        counts: dict[str, int] = json.loads(done.stdout)["counts"]
        return counts
    except (subprocess.TimeoutExpired, ValueError, KeyError):
        return {}


# --- one shape -------------------------------------------------------------------------------


@dataclass
class Judge:
    """Runs one shape's settings and keeps every run; the sweep and the repeats live here."""

    shape: Shape
    items: int
    args: argparse.Namespace
    workdir: Path
    report: Report
    runs: list[Run] = field(default_factory=list)

    def inp(self) -> Path:
        path = self.workdir / f"{self.shape.name}.jsonl"
        if not path.exists():
            with path.open("w") as f:
                for i in range(self.items):
                    prompt = f"Describe product {i} in two short sentences."
                    f.write(json.dumps({"id": f"item-{i}", "prompt": prompt}) + "\n")
        return path

    def reference(self) -> float | None:
        """The best whole-job time so far, any setting: what "slow" is measured against."""
        times = [r.wall_s for r in self.runs if r.finished and not r.failed and r.wall_s]
        return min(times) if times else None

    def limits(self, setting: str) -> Limits:
        ref = self.reference()
        if ref is None:
            return Limits(None, self.shape.first_limit_s)
        hard = max(60.0, 5 * ref)
        return Limits(None if setting == "auto" else self.args.slow_factor * ref, hard)

    def run(self, setting: str, round_no: int) -> Run:
        run = Run(self.shape.name, setting, round_no, self.items)
        home = Path(tempfile.mkdtemp(prefix=f"{self.shape.name}-{setting}-", dir=self.workdir))
        try:
            with serve(self.shape, self.workdir / f"{self.shape.name}-server.log") as url:
                run_job(self.shape, url, setting, home, self.inp(), self.limits(setting), run)
                if self.shape.kind == "shape":
                    run.server_stats = server_stats(url)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            run.note = f"harness error: {exc}"
        finally:
            if not self.args.keep:
                shutil.rmtree(home, ignore_errors=True)
        self.runs.append(run)
        self.report.add(run)
        progress(run)
        return run

    def sweep(self) -> list[int]:
        """Round 1: auto, then fixed levels up from 1 until the server refuses or flattens."""
        self.run("auto", 1)
        best, flat, level = math.inf, 0, 1
        while level <= self.args.max_level:
            run = self.run(str(level), 1)
            refusing = run.finished and run.refused_share >= 0.10
            if run.failed or refusing or run.note.startswith("harness"):
                break
            if run.cut or run.wall_s is None or run.wall_s > 0.95 * best:
                flat += 0 if best == math.inf else 1
            else:
                best, flat = run.wall_s, 0
            if flat >= 2:
                break
            level *= 2
        return self.contenders()

    def contenders(self) -> list[int]:
        """Fixed levels that finished clean within --slow-factor of the best fixed time."""
        clean = {int(r.setting): r for r in self.runs if r.setting != "auto" and r.round == 1}
        clean = {lv: r for lv, r in clean.items() if r.finished and not r.failed}
        if not clean:
            return []
        best = min(r.wall_s or math.inf for r in clean.values())
        return sorted(
            lv for lv, r in clean.items() if (r.wall_s or math.inf) <= self.args.slow_factor * best
        )

    def measure(self) -> None:
        levels = self.sweep()
        for round_no in range(2, self.args.repeat + 1):
            order = [str(lv) for lv in levels]
            order = [*reversed(order), "auto"] if round_no % 2 == 0 else ["auto", *order]
            for setting in order:
                self.run(setting, round_no)


def progress(run: Run) -> None:
    """One line per run on stderr, as it ends, so a long matrix shows it is alive."""
    wall = "-" if run.wall_s is None else f"{'~' if run.cut else ''}{run.wall_s:.1f}s"
    counts = ", ".join(f"{n} {k}" for k, n in run.counts.items() if n) or "no counts"
    limit = f", limit {run.final_limit}" if run.setting == "auto" else ""
    print(
        f"  {run.shape:<10} {run.setting:>5} round {run.round}: {wall:>8}  {counts}, "
        f"{run.refused_share:.1%} refused{limit}{'  ' + run.note if run.note else ''}",
        file=sys.stderr,
        flush=True,
    )


# --- summary ---------------------------------------------------------------------------------


@dataclass
class Level:
    """One fixed level's runs, in short."""

    median_s: float
    cut: bool  # a run was stopped as slow: its time is a projection
    runs: int
    refused: float  # share of all its attempts
    failed: int  # the most items a run failed

    def text(self, level: int) -> str:
        out = f"{level}:{'~' if self.cut else ''}{self.median_s:.1f}s"
        out += f" x{self.runs}" if self.runs > 1 else ""
        out += f" ({self.refused:.0%} refused)" if self.refused >= 0.01 else ""
        return out + (f" ({self.failed} failed)" if self.failed else "")


@dataclass
class Summary:
    """What one shape's runs say about auto."""

    shape: str
    items: int
    skipped: str = ""
    fixed: dict[int, Level] = field(default_factory=dict)
    best_level: int | None = None
    best_s: float | None = None
    auto_s: float | None = None
    share: float | None = None
    refused: float | None = None
    failed: int | None = None
    unfinished: int = 0  # auto runs that did not get every item to a final status
    final_limits: list[int | None] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)


def median_wall(runs: list[Run]) -> float | None:
    walls = [r.wall_s for r in runs if r.wall_s is not None]
    return statistics.median(walls) if walls else None


def summarize(shape: Shape, runs: list[Run], skipped: str = "") -> Summary:
    items = runs[0].items if runs else shape.items
    s = Summary(shape.name, items, skipped)
    if skipped:
        return s
    by_level: dict[int, list[Run]] = {}
    for run in runs:
        if run.setting != "auto":
            by_level.setdefault(int(run.setting), []).append(run)
    for level, level_runs in sorted(by_level.items()):
        wall = median_wall(level_runs)
        if wall is not None:
            s.fixed[level] = level_stat(wall, level_runs)
    eligible = {
        lv: s.fixed[lv].median_s
        for lv, rs in by_level.items()
        if lv in s.fixed and all(r.finished and not r.failed for r in rs)
    }
    if eligible:
        s.best_level = min(eligible, key=eligible.__getitem__)
        s.best_s = eligible[s.best_level]
    auto = [r for r in runs if r.setting == "auto"]
    s.auto_s = median_wall(auto)
    if auto:
        attempts = sum(r.attempts for r in auto)
        s.refused = sum(r.refused for r in auto) / attempts if attempts else 0.0
        s.failed = max(r.failed for r in auto)
        s.unfinished = sum(not r.finished for r in auto)
        s.final_limits = [r.final_limit for r in auto]
    if s.best_s and s.auto_s:
        s.share = s.best_s / s.auto_s
    s.misses = misses(shape, s)
    return s


def level_stat(wall: float, runs: list[Run]) -> Level:
    attempts = sum(r.attempts for r in runs)
    refused = sum(r.refused for r in runs) / attempts if attempts else 0.0
    cut = any(r.cut for r in runs)
    return Level(wall, cut, len(runs), refused, max(r.failed for r in runs))


def misses(shape: Shape, s: Summary) -> list[str]:
    """The targets this shape misses."""
    out = []
    if s.share is None:
        out.append("no share (a side did not finish)")
    elif s.share < 0.9:
        out.append(f"share {s.share:.2f} < 0.9")
    if shape.refused_target and (s.refused is None or s.refused >= 0.01):
        out.append("refused >= 1%")
    if shape.no_failed_target and s.failed != 0:
        out.append("failed items")
    if s.unfinished:
        out.append(f"{s.unfinished} auto runs did not finish")
    return out


def table(summaries: list[Summary]) -> list[str]:
    head = (
        f"{'shape':<10} {'items':>5} {'best fixed':>12} {'auto':>7} {'share':>6} "
        f"{'refused':>8} {'failed':>6} {'auto final limit':>17}  verdict"
    )
    lines = [head]
    for s in summaries:
        if s.skipped:
            lines.append(f"{s.shape:<10} {'':>5} skipped: {s.skipped}")
            continue
        best = f"{s.best_level}: {s.best_s:.1f}s" if s.best_s else "-"
        auto = f"{s.auto_s:.1f}s" if s.auto_s else "-"
        share = f"{s.share:.2f}" if s.share else "-"
        refused = "-" if s.refused is None else f"{s.refused:.2%}"
        limits = "/".join(str(v) for v in s.final_limits) or "-"
        verdict = "ok" if not s.misses else "MISS: " + "; ".join(s.misses)
        lines.append(
            f"{s.shape:<10} {s.items:>5} {best:>12} {auto:>7} {share:>6} "
            f"{refused:>8} {s.failed if s.failed is not None else '-':>6} "
            f"{limits:>17}  {verdict}"
        )
    return lines


def level_lines(summaries: list[Summary]) -> list[str]:
    """Each fixed level's median whole-job time, and its refusals and failures if any."""
    lines = ["fixed levels: median whole-job time (~ projected: stopped as slow; xN: N runs)"]
    for s in summaries:
        if s.fixed:
            parts = [level.text(lv) for lv, level in s.fixed.items()]
            lines.append(f"  {s.shape:<10} " + "  ".join(parts))
    return lines


def verdict(summaries: list[Summary]) -> tuple[str, bool]:
    shares = [s.share for s in summaries if not s.skipped and s.share]
    judged = [s for s in summaries if not s.skipped]
    geo = math.exp(sum(math.log(x) for x in shares) / len(shares)) if shares else None
    missed = [f"{s.shape} ({'; '.join(s.misses)})" for s in judged if s.misses]
    if geo is None or geo < 0.95:
        missed.append("geometric mean < 0.95")
    skipped = [s.shape for s in summaries if s.skipped]
    text = (
        f"geometric mean of auto's share: {geo:.3f} over {len(shares)} shapes (target >= 0.95); "
        if geo
        else "geometric mean of auto's share: - ; "
    )
    text += "PASS" if not missed else "FAIL: " + ", ".join(missed)
    if skipped:
        text += f" (skipped: {', '.join(skipped)})"
    return text, not missed


# --- the JSON file ---------------------------------------------------------------------------


class Report:
    """Every run's row, and at the end the summaries, rewritten whole after each run."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "started": datetime.now().isoformat(timespec="seconds"),
            "args": vars(args),
            "cpus": os.cpu_count(),
            "shapes": {},
            "runs": [],
        }

    def shape(self, shape: Shape, items: int) -> None:
        flags = SERVER_SHAPES[shape.name].flags if shape.kind == "shape" else None
        self.data["shapes"][shape.name] = {**asdict(shape), "items": items, "server": flags}

    def add(self, run: Run) -> None:
        row = {**asdict(run), "failed": run.failed, "finished": run.finished}
        self.data["runs"].append(row)
        self.write()

    def finish(self, summaries: list[Summary], text: str) -> None:
        self.data["summaries"] = [asdict(s) for s in summaries]
        self.data["verdict"] = text
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


# --- command line ----------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated; see --list")
    p.add_argument("--repeat", type=int, default=3, help="runs of auto and each contender")
    p.add_argument("--items", type=float, default=1.0, help="scale every job's item count")
    p.add_argument("--quick", action="store_true", help="1 repeat, jobs at 0.4x: a smoke run")
    p.add_argument("--max-level", type=int, default=256, help="the highest fixed level")
    p.add_argument("--slow-factor", type=float, default=2.0, help="x best: slow, run once")
    p.add_argument("--json", type=Path, help="the runs' file [outputs/concurrency-matrix-*.json]")
    p.add_argument("--keep", action="store_true", help="keep each run's home (in --workdir)")
    p.add_argument("--workdir", type=Path, help="inputs, homes and server logs [a temp dir]")
    p.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = p.parse_args()
    if args.quick:
        args.repeat, args.items = 1, args.items * 0.4
    unknown = set(args.shapes.split(",")) - set(SHAPES)
    if unknown:
        p.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}")
    if args.json is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        args.json = REPO / "outputs" / f"concurrency-matrix-{stamp}.json"
    return args


def main() -> int:
    args = parse_args()
    if args.list:
        for shape in SHAPES.values():
            print(f"{shape.name:<10} {shape.doc}")
        return 0
    # Ctrl-C and kill both end the matrix through the same cleanup: no server or CLI is left
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="concurrency-matrix-"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = Report(args.json, args)
    print(f"runs -> {args.json}; work files in {workdir}", file=sys.stderr)
    summaries: list[Summary] = []
    try:
        interrupted = run_matrix(args, workdir, report, summaries)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    text, passed = verdict(summaries)
    if interrupted:
        text = "interrupted: only the runs so far; " + text
    print("\n".join(["", *table(summaries), "", *level_lines(summaries), "", text]), flush=True)
    report.finish(summaries, text)
    return 130 if interrupted else 0 if passed else 1


def run_matrix(
    args: argparse.Namespace, workdir: Path, report: Report, summaries: list[Summary]
) -> bool:
    """Judge each shape in turn, adding to `summaries`; True when Ctrl-C cut it short (the
    runs so far still make a table: a long matrix stopped midway is not wasted)."""
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        items = max(50, round(shape.items * args.items))
        report.shape(shape, items)
        why = missing(shape)
        if why:
            print(f"  {name}: skipped: {why}", file=sys.stderr)
            summaries.append(summarize(shape, [], skipped=why))
            continue
        judge = Judge(shape, items, args, workdir, report)
        try:
            judge.measure()
        except KeyboardInterrupt:
            if judge.runs:
                summaries.append(summarize(shape, judge.runs))
            return True
        summaries.append(summarize(shape, judge.runs))
    return False


if __name__ == "__main__":
    sys.exit(main())
