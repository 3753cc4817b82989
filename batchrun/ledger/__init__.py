"""The ledger: the only code that imports SQLAlchemy."""

from batchrun.ledger.engine import shown_url
from batchrun.ledger.records import ClaimedItem, IngestReport, ItemResult, Job
from batchrun.ledger.schema import FINAL_STATUSES, STATUSES
from batchrun.ledger.store import Ledger
from batchrun.ledger.workers import Worker

__all__ = [
    "FINAL_STATUSES",
    "STATUSES",
    "ClaimedItem",
    "IngestReport",
    "ItemResult",
    "Job",
    "Ledger",
    "Worker",
    "shown_url",
]
