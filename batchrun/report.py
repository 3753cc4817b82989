"""What a submit or resume hands back (JobReport), and what it raises instead when the job
stopped with items left (JobAborted, which carries the report)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchrun.errors import FatalError
from batchrun.ledger import left
from batchrun.preview import Preview
from batchrun.run_state import RunStats


@dataclass(frozen=True)
class JobReport:
    """What a submit or resume did, and where the job stands."""

    job: str
    counts: dict[str, int]  # items by status: pending, running, done, failed, invalid, rejected
    complete: bool  # no item left to send; the results file is written
    output: Path | None  # the results file, once complete
    loaded: int | None = None  # items this call loaded (None: the job was there already)
    rejected: int = 0  # bad lines this call recorded as rejected (skip_invalid)
    notes: tuple[str, ...] = ()  # things the caller should know (the input file changed...)
    stats: RunStats = field(default_factory=RunStats)  # this run's requests, retries, tokens
    workers: int = 1  # processes that worked on the job while this one ran (this one too)
    preview: Preview | None = None  # with run=False: what a run would send and cost

    @property
    def ok(self) -> bool:
        """Complete, with every line done."""
        return self.complete and self.counts["done"] == sum(self.counts.values())


class JobAborted(FatalError):
    """The job stopped with items left: the endpoint refused the key or the model, or stayed
    down past the outage grace, or a budget ran out (the command line's exit 3). Raised, not
    returned, so that a pipeline that forgets to look at `ok` does not carry on as if the job
    had run; `report` says where it stands (what finished is committed; the rest is pending
    for `resume`)."""

    def __init__(self, report: JobReport) -> None:
        waiting = left(report.counts)
        super().__init__(f"{report.stats.aborted} (job {report.job}: {waiting} item(s) left)")
        self.report = report


def checked(report: JobReport) -> JobReport:
    """`report`, unless the endpoint stopped its job with items left (JobAborted)."""
    if report.stats.aborted and left(report.counts):
        raise JobAborted(report)
    return report
