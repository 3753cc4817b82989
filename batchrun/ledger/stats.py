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
    errors = conn.execute(
        select(items.c.error, func.count().label("n"))
        .where(items.c.job == name, items.c.error.is_not(None))
        .group_by(items.c.error)
        .order_by(func.count().desc())
        .limit(5)
    ).all()
    return {
        "prompt_tokens": int(totals[0] or 0),
        "completion_tokens": int(totals[1] or 0),
        "attempts": int(totals[2] or 0),
        "latency_ms": {
            "p50": _percentile(latencies, 0.50),
            "p95": _percentile(latencies, 0.95),
            "p99": _percentile(latencies, 0.99),
        },
        "top_errors": [{"error": e, "count": int(n)} for e, n in errors],
    }


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[index])
