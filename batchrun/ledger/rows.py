"""Rows to records: the JSON columns parsed once here, so callers get typed values."""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter
from typing import Any

import orjson
from sqlalchemy import Row, RowMapping, Update, bindparam, case, func, literal_column, null, update

from batchrun.ledger.records import ClaimedItem, ItemResult, Job, StoredItem
from batchrun.ledger.schema import items
from batchrun.ledger.stats import OWN_ANSWER
from batchrun.prefixes import LINE_BITS


def as_json(value: Any) -> str:
    return orjson.dumps(value).decode()


def job_of(row: RowMapping) -> Job:
    """A jobs row with its JSON columns parsed."""
    history = row["limit_history"]
    moves = [(t, limit, reason) for t, limit, reason in orjson.loads(history)] if history else []
    return Job(**{**row, "spec": orjson.loads(row["spec"]), "limit_history": moves})


STORED_COLUMNS = [items.c[f.name] for f in fields(StoredItem) if f.name in items.c]


# What an item's results add up to over its runs; the rest of a result replaces the old.
SUMMED = (
    "attempts",
    "repairs",
    "repair_prompt_tokens",
    "repair_completion_tokens",
    "extra_prompt_tokens",
    "extra_completion_tokens",
)


# ItemResult's fields as a recorded row holds them: its answer options first (the run's where
# it has none), then the rest in order.
RESULT_FIELDS = tuple(f for f in ItemResult.__slots__ if f != "answer_spec")
_result_fields = attrgetter(*RESULT_FIELDS)


def recording(*, batched: bool) -> tuple[Update, tuple[str, ...]]:
    """The statement that records one result, and what its rows hold (`result_row`'s order).

    Counts are summed over runs, the rest replaced; no owner, lease or follow-up after. The
    guard (still running and the caller's; `batched`: still in the caller's hosted batch)
    makes a late or duplicate result a no-op."""
    status, holder = ("batched", items.c.chunk) if batched else ("running", items.c.owner)
    values: dict[str, Any] = {
        name: items.c[name] + bindparam(f"b_{name}") if name in SUMMED else bindparam(f"b_{name}")
        for name in ItemResult.__slots__
        if name != "line"
    }
    stmt = (
        update(items)
        .where(
            items.c.job == bindparam("b_job"),
            items.c.line == bindparam("b_line"),
            items.c.status == literal_column(f"'{status}'"),
            holder == bindparam("b_holder"),
        )
        .values(
            **values,
            owner=null(),
            lease_expires=null(),
            followup=null(),
            updated_at=bindparam("b_now"),
        )
    )
    names = ("b_job", "b_holder", "b_now", "b_answer_spec", *(f"b_{f}" for f in RESULT_FIELDS))
    return stmt, names


def requeueing(job: str, statuses: tuple[str, ...], now: float) -> Update:
    """`retry`'s statement: the job's items of `statuses` back to pending, with a fresh
    --max-attempts. The tokens their answers used stay paid for (moved to the extra counts,
    which budgets and `status` count)."""
    return (
        update(items)
        .where(items.c.job == job, items.c.status.in_(statuses))
        .values(
            status="pending",
            charged=0,
            error=None,
            answer_spec=None,  # a source no more (reuse.NOT_A_SOURCE)
            output=None,
            parsed=None,
            finish_reason=None,
            extra_prompt_tokens=items.c.extra_prompt_tokens + _own(items.c.prompt_tokens),
            extra_completion_tokens=items.c.extra_completion_tokens
            + _own(items.c.completion_tokens),
            prompt_tokens=None,
            completion_tokens=None,
            updated_at=now,
        )
    )


def _own(tokens: Any) -> Any:
    """An item's tokens if its own request paid them (not copied from another line's answer)."""
    return case((OWN_ANSWER, func.coalesce(tokens, 0)), else_=0)


def result_row(
    head: tuple[Any, ...], result: ItemResult, answer_spec: str | None
) -> tuple[Any, ...]:
    """`recording`'s row for `result`: `head` is (job, owner or batch, now)."""
    return (*head, result.answer_spec or answer_spec, *_result_fields(result))


def stored_of(row: RowMapping) -> StoredItem:
    """A results row; with its `body` (when the query took it), the model the line asked."""
    values = dict(row)
    meta, parsed, body = values["meta"], values["parsed"], values.pop("body", None)
    values["meta"] = orjson.loads(meta) if meta else None
    values["parsed"] = orjson.loads(parsed) if parsed else None
    if body and "model" in body:  # only a line that names one is read
        asked = orjson.loads(body).get("model")
        values["model"] = asked if isinstance(asked, str) else None
    return StoredItem(**values)


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
    items.c.charged,
)


def claimed_of(row: Row[Any]) -> ClaimedItem:
    """A claimed row (CLAIMED_COLUMNS), its body parsed and its prefix group read from its
    place in the order."""
    line, item_id, endpoint, body, digest, attempts, sched, followup, charged = tuple(row)
    group = sched >> LINE_BITS  # its group's first line (its own line, alone)
    previous = orjson.loads(followup) if followup else None
    return ClaimedItem(
        line,
        item_id,
        endpoint,
        orjson.loads(body),
        digest,
        attempts,
        group,
        sched,
        previous,
        charged,
    )
