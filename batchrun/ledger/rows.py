"""Rows to records: the JSON columns parsed once here, so callers get typed values."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import orjson
from sqlalchemy import Row, RowMapping, bindparam

from batchrun.ledger.records import ClaimedItem, ItemResult, Job, StoredItem
from batchrun.ledger.schema import items
from batchrun.prefixes import LINE_BITS


def as_json(value: Any) -> str:
    return orjson.dumps(value).decode()


def job_of(row: RowMapping) -> Job:
    """A jobs row with its JSON columns parsed."""
    history = row["limit_history"]
    moves = [(t, limit, reason) for t, limit, reason in orjson.loads(history)] if history else []
    return Job(**{**row, "spec": orjson.loads(row["spec"]), "limit_history": moves})


STORED_COLUMNS = [items.c[f.name] for f in fields(StoredItem)]

# What an item's results add up to over its runs; the rest of a result replaces the old.
SUMMED = (
    "attempts",
    "repairs",
    "repair_prompt_tokens",
    "repair_completion_tokens",
    "extra_prompt_tokens",
    "extra_completion_tokens",
)


def result_values(now: float) -> dict[str, Any]:
    """The columns a recorded ItemResult sets, from `b_<field>` parameters (`line` picks the
    row): counts summed over runs, the rest replaced; no owner, no lease, no follow-up."""
    values: dict[str, Any] = {
        name: items.c[name] + bindparam(f"b_{name}") if name in SUMMED else bindparam(f"b_{name}")
        for name in ItemResult.__slots__
        if name != "line"
    }
    return {**values, "owner": None, "lease_expires": None, "followup": None, "updated_at": now}


def stored_of(row: RowMapping) -> StoredItem:
    meta, parsed = row["meta"], row["parsed"]
    return StoredItem(
        **{
            **row,
            "meta": orjson.loads(meta) if meta else None,
            "parsed": orjson.loads(parsed) if parsed else None,
        }
    )


# What a claim hands out, in claimed_of's order.
CLAIMED_COLUMNS = (
    items.c.line,
    items.c.item_id,
    items.c.endpoint,
    items.c.body,
    items.c.digest,
    items.c.attempts,
    items.c.sched,
    items.c.followup,
)


def claimed_of(row: Row[Any]) -> ClaimedItem:
    """A claimed row (line, item_id, endpoint, body, digest, attempts, sched), its body
    parsed and its prefix group read from its place in the order."""
    line, item_id, endpoint, body, digest, attempts, sched, followup = tuple(row)
    group = sched >> LINE_BITS  # its group's first line (its own line, alone)
    previous = orjson.loads(followup) if followup else None
    return ClaimedItem(
        line, item_id, endpoint, orjson.loads(body), digest, attempts, group, sched, previous
    )
