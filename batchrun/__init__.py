"""batchrun: push large JSONL files of prompts through OpenAI-compatible endpoints, durably.

The names below are the whole public API; every module under batchrun/ is private.

    import batchrun
    report = batchrun.submit("prompts.jsonl", backend="sim")
    for result in batchrun.results(report.job):
        print(result.line, result.status, result.output)
"""

__version__ = "0.1.0"  # before the imports: modules below read it

from batchrun.api import (
    cancel,
    export,
    list_jobs,
    results,
    resume,
    resume_async,
    retry,
    status,
    submit,
    submit_async,
)
from batchrun.config import RunOptions
from batchrun.errors import (
    BatchrunError,
    FatalError,
    InputError,
    LedgerError,
    OutputError,
    UsageError,
)
from batchrun.outputs import Result
from batchrun.progress import ProgressUpdate
from batchrun.report import JobAborted, JobReport
from batchrun.retention import GcReport, gc

__all__ = [
    "BatchrunError",
    "FatalError",
    "GcReport",
    "InputError",
    "JobAborted",
    "JobReport",
    "LedgerError",
    "OutputError",
    "ProgressUpdate",
    "Result",
    "RunOptions",
    "UsageError",
    "__version__",
    "cancel",
    "export",
    "gc",
    "list_jobs",
    "results",
    "resume",
    "resume_async",
    "retry",
    "status",
    "submit",
    "submit_async",
]
