"""What the CLI makes of a job's report: its exit code, its summary line, and a progress bar
drawn from the library's progress updates."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

from tqdm import tqdm

from batchrun import api
from batchrun.cli_errors import (
    EXIT_ABORTED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SOME_FAILED,
    printable,
    say,
)
from batchrun.lanes import EndpointUse
from batchrun.ledger import FINAL_STATUSES
from batchrun.ledger import left as open_items
from batchrun.progress import ProgressUpdate
from batchrun.report import JobAborted, JobReport


def exit_code(report: JobReport) -> int:
    counts, stats = report.counts, report.stats
    left = open_items(counts)
    if stats.aborted and left:
        return EXIT_ABORTED
    if stats.interrupted and left:
        return EXIT_INTERRUPTED
    if left:
        return EXIT_SOME_FAILED
    bad = counts["failed"] + counts["invalid"] + counts["rejected"]
    return EXIT_SOME_FAILED if bad else EXIT_OK


def summary_line(report: JobReport) -> str:
    name, counts, stats = report.job, report.counts, report.stats
    parts = [f"job {name}:"] + [
        f"{counts[s]} {s}"
        for s in (*FINAL_STATUSES, "pending", "running", "batched")  # running: other workers
        if counts[s] or s == "done"
    ]
    text = " ".join(parts[:2]) + (", " + ", ".join(parts[2:]) if len(parts) > 2 else "")
    if stats.requests:
        secs = max(stats.elapsed, 1e-9)
        text += (
            f" | {stats.requests} requests, {stats.retries} retries, {secs:.1f}s, "
            f"{stats.recorded / secs:.1f} items/s, {stats.output_tokens / secs:,.0f} out tok/s"
        )
    if stats.reused or stats.duplicates:
        text += f" | {stats.reused} reused from earlier jobs"
        if stats.duplicates:  # marked before the run: whether it then answered them is above
            text += f", {stats.duplicates} repeated lines take their first line's answer"
    if report.workers > 1:
        text += f" | {report.workers} workers"
    if stats.batches or stats.batch_tokens:
        text += (
            f" | {stats.batches} batch(es) created, {stats.batch_tokens:,} tokens at batch rates"
        )
    if stats.followups:
        text += (
            f" | {stats.followups} batch answers wait for a follow-up sent online: "
            f"`batchrun resume {name} --mode online`"
        )
    if len(stats.endpoints) > 1:
        text += " | endpoints: " + ", ".join(_endpoint_use(e) for e in stats.endpoints)
    if stats.repairs:
        text += f" | {stats.repairs} repairs ({stats.repair_tokens:,} tokens)"
    if stats.guided_refused:
        text += f" | the server refused response_format, sent without it: {stats.guided_refused}"
    if stats.aborted:
        text += f" | ABORTED: {stats.aborted}"
        if not open_items(counts):  # it stopped with its last follow-up: all are answered
            text += " (nothing is left to send: the job is complete)"
    elif stats.interrupted and counts["pending"]:
        text += " | interrupted; run `batchrun resume " + name + "` to continue"
    elif open_items(counts):  # other workers' items, a batch cancelled, expired or still running
        text += f" | not finished: `batchrun resume {name}` sends or collects the rest"
    if report.output is not None:
        text += f" | results: {report.output}"
    return text


def _endpoint_use(e: EndpointUse) -> str:
    said = f"{e.name} {e.answered} answered"
    if e.state != "up":
        said += f" ({e.state}: {e.reason[:120]})" if e.reason else f" ({e.state})"
    return said


class ProgressBar:
    """A tqdm bar on stderr (terminals only, and not with --quiet): req/s, output tok/s,
    concurrency, retries and failures."""

    def __init__(self, *, quiet: bool) -> None:
        self._enabled = not quiet and sys.stderr.isatty()
        self._bar: tqdm[Any] | None = None

    def __call__(self, update: ProgressUpdate) -> None:
        if not self._enabled:
            return
        bar = self._bar
        if bar is None:
            bar = self._bar = tqdm(
                total=update.total,
                initial=update.done,
                unit="req",
                file=sys.stderr,
                dynamic_ncols=True,
                smoothing=0.1,
            )
        bar.set_postfix_str(
            f"{update.output_tokens / max(update.elapsed, 1e-9):,.0f} tok/s, "
            f"conc {update.concurrency}, retries {update.retries}, failed {update.failed}",
            refresh=False,
        )
        bar.update(update.done - bar.n)

    def say(self, message: str) -> None:
        """A line above the bar (or alone, when none is drawn)."""
        if self._bar is None:
            say(message)
        else:
            tqdm.write(f"batchrun: {printable(message)}", file=sys.stderr)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()  # before anything else is printed, error or summary

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def ran(call: Callable[..., Awaitable[JobReport]], options: dict[str, Any]) -> JobReport:
    """The report of a submit or resume, of one the endpoint stopped too (exit 3: finish)."""
    try:
        return api.in_new_loop(call, options)
    except JobAborted as stopped:
        return stopped.report


def finish(report: JobReport, *, quiet: bool) -> None:
    """The summary line, then the exit code."""
    if quiet:  # the notes were not said as they came
        for note in report.notes:
            say(note)
    say(summary_line(report))
    sys.exit(exit_code(report))
