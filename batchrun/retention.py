"""Retention: `gc` removes old jobs, keeping the answers that later jobs may reuse."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from batchrun.api import _home, _ledger
from batchrun.errors import UsageError
from batchrun.jobs import Home
from batchrun.ledger import Job
from batchrun.ledger.gc import Collected
from batchrun.outputs import FORMATS
from batchrun.reuse import seconds
from batchrun.row_input import ROWS_FILE, PathLike
from batchrun.run_state import LEASE_TTL


@dataclass(frozen=True)
class GcReport:
    """What `gc` removed."""

    jobs: list[str]  # old jobs collected (their results files and logs removed too)
    removed: int  # item rows deleted
    kept: int  # answers kept for reuse (their request bodies emptied)
    running: list[str]  # old jobs left alone: a worker runs them, or a batch may answer them


def gc(
    older_than: str | timedelta = "30d",
    *,
    everything: bool = False,
    home: PathLike = ".",
    ledger: str | None = None,
) -> GcReport:
    """Remove jobs untouched for `older_than` ("30d", "12h"): their items, results files and
    logs, keeping the answers later jobs may reuse (or nothing: `everything`); then give the
    space back. A job a live worker is running is never touched."""
    if isinstance(older_than, timedelta):
        age = older_than.total_seconds()
    elif isinstance(older_than, str):
        age = seconds(older_than, key="older_than", unit=True)
    else:  # a bare 30: days or seconds? Asking is cheaper than a wrong guess that deletes
        kind = type(older_than).__name__
        raise UsageError(f"older_than must be a duration like '30d' or a timedelta, not {kind}")
    where = _home(home, ledger)
    with _ledger(where, existing=True) as led:
        read_by = {job.name: job.input_path for job in led.list_jobs()}  # --all deletes jobs
        done = led.collect(before=time.time() - age, everything=everything, ttl=LEASE_TTL)
        _remove_files(where, done, read_by, led.list_jobs())
        if done.jobs:  # after the files: a VACUUM that fails (busy) leaves none behind
            led.reclaim_space()
    return GcReport(done.jobs, done.removed, done.kept, done.running)


def _remove_files(where: Home, done: Collected, read_by: dict[str, str], left: list[Job]) -> None:
    """The collected jobs' results files and logs, and the rows files no job left reads.
    Every collected job's, not only this run's: a gc stopped after its collection committed
    left them, and nothing else removes them."""
    gone = {*done.jobs, *(job.name for job in left if job.collected_at is not None)}
    unread = {read_by[name] for name in done.jobs}
    unread |= {job.input_path for job in left if job.collected_at is not None}
    unread -= {job.input_path for job in left if job.collected_at is None}
    for name in gone:
        for path in (*(where.output_path(name, fmt) for fmt in FORMATS), where.log_path(name)):
            path.unlink(missing_ok=True)
    for path in _rows_files(unread, where.root / "inputs"):
        path.unlink(missing_ok=True)


def _rows_files(paths: set[str], folder: Path) -> set[Path]:
    """Of the input files `paths` that no job left to run reads, those batchrun wrote for rows
    handed over from Python (`inputs/rows-<16 hex digits>.jsonl`, as row_input names them): a
    user's own files are never touched, even one named `rows-2026-11.jsonl`."""
    folder = folder.resolve()
    return {p for p in map(Path, paths) if p.parent == folder and ROWS_FILE.fullmatch(p.name)}
