"""The ledger: the only code that imports SQLAlchemy."""

from batchrun.ledger.chunks import Chunk, run_owner
from batchrun.ledger.dialect import file_ledger_url, home_expanded, ledger_file
from batchrun.ledger.engine import shown_url
from batchrun.ledger.joins import Joining
from batchrun.ledger.records import (
    ClaimedItem,
    IngestReport,
    ItemResult,
    Job,
    Recorded,
    Spent,
)
from batchrun.ledger.schema import FINAL_STATUSES, OPEN_STATUSES, STATUSES, left
from batchrun.ledger.store import Ledger
from batchrun.ledger.workers import Worker

__all__ = [
    "FINAL_STATUSES",
    "OPEN_STATUSES",
    "STATUSES",
    "Chunk",
    "ClaimedItem",
    "IngestReport",
    "ItemResult",
    "Job",
    "Joining",
    "Ledger",
    "Recorded",
    "Spent",
    "Worker",
    "file_ledger_url",
    "home_expanded",
    "ledger_file",
    "left",
    "run_owner",
    "shown_url",
]
