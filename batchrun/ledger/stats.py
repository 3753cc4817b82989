"""Statistics over a job's items: token totals, latency percentiles, the commonest errors."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, func, select

from batchrun.ledger.schema import FINAL_STATUSES, STATUSES, items

# An item whose answer its own request made (and paid for): not reused from an earlier job,
# not copied from the line it repeats.
OWN_ANSWER = and_(items.c.reused_job.is_(None), items.c.dup_of.is_(None))


def counts(conn: Connection, name: str) -> dict[str, int]:
    """The job's items by status, every status named."""
    query = select(items.c.status, func.count()).where(items.c.job == name)
    found = {status: int(n) for status, n in conn.execute(query.group_by(items.c.status))}
    return {s: found.get(s, 0) for s in STATUSES}


def attempts(conn: Connection, name: str) -> int:
    total = conn.execute(select(func.sum(items.c.attempts)).where(items.c.job == name))
    return int(total.scalar() or 0)


def item_stats(conn: Connection, name: str) -> dict[str, Any]:
    """Token totals, latency percentiles of the requests that answered its done items (not
    of answers copied from an earlier job or from a repeated line), the commonest errors."""
    # Tokens this job paid for: a reused answer, or one copied to a repeated line, cost
    # nothing here (it carries the usage of the request that made it).
    copied = and_(  # answered by the line it repeats (not by an earlier job)
        items.c.dup_of.is_not(None),
        items.c.reused_job.is_(None),
        items.c.status.in_(FINAL_STATUSES),
    )
    totals = conn.execute(
        select(
            _paid(items.c.prompt_tokens, items.c.extra_prompt_tokens),
            _paid(items.c.completion_tokens, items.c.extra_completion_tokens),
            func.sum(items.c.attempts),
            func.sum(items.c.repairs),
            func.sum(items.c.repair_prompt_tokens),
            func.sum(items.c.repair_completion_tokens),
            func.count().filter(items.c.reused_job.is_not(None)),
            func.count().filter(copied),
        ).where(items.c.job == name)
    ).one()
    latencies: list[float] = list(
        conn.execute(
            select(items.c.latency_ms)
            .where(
                items.c.job == name,
                items.c.status == "done",
                items.c.latency_ms.is_not(None),
                OWN_ANSWER,  # its own requests' latencies, not those of the answers it copied
            )
            .order_by(items.c.latency_ms)
        )
        .scalars()
        .all()
    )
    errors = _commonest_errors(conn, name, None)
    invalid = _commonest_errors(conn, name, "invalid")
    return {
        "prompt_tokens": int(totals[0]),
        "completion_tokens": int(totals[1]),
        "attempts": int(totals[2] or 0),
        "latency_ms": {
            "p50": _percentile(latencies, 0.50),
            "p95": _percentile(latencies, 0.95),
            "p99": _percentile(latencies, 0.99),
        },
        "repairs": {
            "requests": int(totals[3] or 0),
            "prompt_tokens": int(totals[4] or 0),
            "completion_tokens": int(totals[5] or 0),
        },
        "reused": int(totals[6] or 0),  # answers copied from earlier jobs
        "repeated": int(totals[7] or 0),  # lines answered by an identical line's request
        "top_errors": errors,
        "top_invalid": invalid,
        "answered_by": _by_endpoint(conn, name),
    }


def _by_endpoint(conn: Connection, name: str) -> dict[str, dict[str, int]]:
    """Items by the endpoint of their last request and their status (jobs with several)."""
    rows = conn.execute(
        select(items.c.answered_by, items.c.status, func.count())
        .where(items.c.job == name, items.c.answered_by.is_not(None))
        .group_by(items.c.answered_by, items.c.status)
    ).all()
    found: dict[str, dict[str, int]] = {}
    for endpoint, status, n in rows:
        found.setdefault(endpoint, {})[status] = int(n)
    return found


def _commonest_errors(conn: Connection, name: str, status: str | None) -> list[dict[str, Any]]:
    where = [items.c.job == name, items.c.error.is_not(None)]
    if status is not None:
        where.append(items.c.status == status)
    rows = conn.execute(
        select(items.c.error, func.count().label("n"))
        .where(*where)
        .group_by(items.c.error)
        .order_by(func.count().desc())
        .limit(5)
    ).all()
    return [{"error": e, "count": int(n)} for e, n in rows]


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[index])


def _paid(answer: Any, extra: Any) -> Any:
    """Tokens the job's items paid for themselves: their answers' (unless copied: reused, or
    a repeat's), and those no answer shows (`extra`: paid whatever the line became since)."""
    own = func.coalesce(func.sum(answer).filter(OWN_ANSWER), 0)
    return own + func.coalesce(func.sum(extra), 0)


def paid_tokens(conn: Connection, name: str) -> tuple[int, int]:
    """Prompt and completion tokens the job paid for (repairs, answers a `retry` set aside and
    the estimates charged where no usage came, too; not reused answers)."""
    query = select(
        _paid(items.c.prompt_tokens, items.c.extra_prompt_tokens)
        + func.coalesce(func.sum(items.c.repair_prompt_tokens), 0),
        _paid(items.c.completion_tokens, items.c.extra_completion_tokens)
        + func.coalesce(func.sum(items.c.repair_completion_tokens), 0),
    ).where(items.c.job == name)
    row = conn.execute(query).one()
    return int(row[0] or 0), int(row[1] or 0)
