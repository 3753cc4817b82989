"""Statistics over a job's items: token totals, latency percentiles, the commonest errors."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, select

from batchrun.ledger.schema import items


def item_stats(conn: Connection, name: str) -> dict[str, Any]:
    """Token totals, latency percentiles of done items and the commonest errors."""
    totals = conn.execute(
        select(
            func.sum(items.c.prompt_tokens),
            func.sum(items.c.completion_tokens),
            func.sum(items.c.attempts),
            func.sum(items.c.repairs),
            func.sum(items.c.repair_prompt_tokens),
            func.sum(items.c.repair_completion_tokens),
        ).where(items.c.job == name)
    ).one()
    latencies: list[float] = list(
        conn.execute(
            select(items.c.latency_ms)
            .where(
                items.c.job == name,
                items.c.status == "done",
                items.c.latency_ms.is_not(None),
            )
            .order_by(items.c.latency_ms)
        )
        .scalars()
        .all()
    )
    errors = _commonest_errors(conn, name, None)
    invalid = _commonest_errors(conn, name, "invalid")
    return {
        "prompt_tokens": int(totals[0] or 0),
        "completion_tokens": int(totals[1] or 0),
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
        "top_errors": errors,
        "top_invalid": invalid,
    }


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
