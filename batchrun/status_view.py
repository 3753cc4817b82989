"""What `batchrun status` shows: a table of jobs, or one job in detail (also as JSON)."""

from __future__ import annotations

from typing import Any

from batchrun.endpoints import shown_endpoint
from batchrun.ledger import STATUSES, Job, Ledger, Worker, left
from batchrun.run_state import LEASE_TTL


def _state(counts: dict[str, int], attempts: int, seen: list[Worker], now: float, job: Job) -> str:
    """`seen`: every worker that joined it (a run that sent requests and was stopped, or
    aborted, has one even where no item kept an attempt: it is "stopped", not "not started")."""
    live = [w for w in seen if w.alive(now, _lease(job))]
    kept = sum(counts.values())
    if job.collected(kept):
        return f"collected by gc ({kept:,} answers kept for reuse)"
    if len(live) == 1:
        return f"running (pid {live[0].pid} on {live[0].host})"
    if live:
        return f"running ({len(live)} workers)"
    if counts.get("batched"):
        return f"at the batch provider ({counts['batched']} items; `resume` collects them)"
    if left(counts):
        return "stopped" if attempts or seen else "not started"  # nothing ever ran it
    bad = counts["failed"] + counts["invalid"] + counts["rejected"]
    return "complete" if not bad else "complete with failures"


def jobs_table(ledger: Ledger) -> list[dict[str, Any]]:
    rows = []
    for job in ledger.list_jobs():
        counts = ledger.counts(job.name)
        seen, now = ledger.workers(job.name), ledger.now()
        state = _state(counts, ledger.attempts(job.name), seen, now, job)
        rows.append({"job": job.name, "state": state, "total": job.total, **counts})
    return rows


def job_detail(ledger: Ledger, job: Job) -> dict[str, Any]:
    counts = ledger.counts(job.name)
    stats = ledger.item_stats(job.name)
    answered = stats.pop("answered_by")
    spec, now, lease = job.spec, ledger.now(), _lease(job)  # heartbeats are in its clock
    workers = ledger.workers(job.name)
    return {
        "job": job.name,
        "state": _state(counts, stats["attempts"], workers, now, job),
        "input": job.input_path,
        "input_digest": job.input_digest,
        "total": job.total,
        "counts": counts,
        "endpoint": {
            "backend": spec.get("backend"),
            "base_url": spec.get("base_url") and shown_endpoint(spec["base_url"]),
            # the job's, or its one named endpoint's (several: each below)
            "model": spec.get("model")
            or next(iter((spec.get("endpoint_models") or {}).values()), None),
            "endpoint": spec.get("endpoint"),
            "several": len(spec.get("endpoints") or ()),  # endpoints given: each shown below
        },
        "concurrency": spec.get("concurrency"),
        "schema": spec.get("schema"),
        "limit_history": job.limit_history,
        "created_at": job.created_at,
        "finished_at": job.finished_at,
        "workers": [_worker(w, now, lease) for w in workers],
        **stats,
        "endpoints": _endpoints(answered, workers, now, lease),
        "batches": [
            {
                "chunk": c.chunk,
                "id": c.batch_id,
                "state": c.state,
                "lines": c.lines,
                "counts": c.counts,
            }
            for c in ledger.chunks.listed(job.name)
        ],
    }


def _endpoints(
    answered: dict[str, dict[str, int]], workers: list[Worker], now: float, lease: float
) -> list[dict[str, Any]]:
    """Per endpoint of a job with several: items by status (from the ledger), and its state,
    errors, limit and rate as the live workers see it (the latest worker when none lives)."""
    seen = [w for w in workers if w.endpoints and w.alive(now, lease)]
    seen = seen or [w for w in workers if w.endpoints][-1:]
    shown: dict[str, dict[str, Any]] = {}
    for w in seen:
        elapsed = max(w.heartbeat - w.started_at, 1e-9)
        for name, e in (w.endpoints or {}).items():
            one = shown.setdefault(name, {"name": name, "errors": 0, "limit": 0, "per_s": 0.0})
            state = e.get("state", "-")
            one["state"] = state if one.get("state") in (None, "up") else one["state"]
            one["reason"] = e.get("reason") or one.get("reason", "")
            one["errors"] += e.get("errors", 0)
            one["limit"] += e.get("limit", 0)
            one["per_s"] = round(one["per_s"] + e.get("answered", 0) / elapsed, 1)
    for name, counts in answered.items():
        shown.setdefault(name, {"name": name, "state": "-", "errors": 0, "limit": 0, "per_s": 0.0})
        shown[name]["items"] = counts
    return [{"items": {}, **e} for e in shown.values()]


def _lease(job: Job) -> float:
    """The lease the job last ran with (--lease)."""
    lease = job.spec.get("lease")
    return float(lease) if isinstance(lease, (int, float)) else LEASE_TTL


def _worker(w: Worker, now: float, lease: float) -> dict[str, Any]:
    """A worker as `status` shows it: where, since when, what it did, and whether it lives."""
    return {
        "id": w.id[:12],
        "host": w.host,
        "pid": w.pid,
        "state": "running" if w.alive(now, lease) else "stopped",
        "started_at": w.started_at,
        "heartbeat_age_s": round(now - w.heartbeat, 1),
        "recorded": w.recorded,
        "requests": w.requests,
        "items_per_s": round(w.recorded / max(w.heartbeat - w.started_at, 1e-9), 1),
    }


def render_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no jobs yet"
    columns = ["job", "state", "total", *STATUSES]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


def render_detail(d: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {s}" for s, n in d["counts"].items() if n)
    ep = d["endpoint"]
    lat = d["latency_ms"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f} ms"

    lines = [
        f"job        {d['job']}  ({d['state']})",
        f"input      {d['input']}",
        f"items      {d['total']}: {counts or 'none'}",
        f"endpoint   {ep['backend']} {ep['base_url']} model={ep['model']} ({ep['endpoint']})"
        if ep.get("several", 0) < 2
        else f"endpoints  {ep['several']}, each below ({ep['endpoint']})",
        f"tokens     {d['prompt_tokens']:,} prompt, {d['completion_tokens']:,} completion",
        f"requests   {d['attempts']:,} attempts",
        f"latency    p50 {ms(lat['p50'])}, p95 {ms(lat['p95'])}, p99 {ms(lat['p99'])}",
    ]
    if d["reused"] or d["repeated"]:
        lines.append(
            f"reused     {d['reused']:,} answers from earlier jobs, {d['repeated']:,} repeated "
            "lines answered once (not sent; their tokens are not counted above)"
        )
    rep = d["repairs"]
    if rep["requests"]:
        lines.append(
            f"repairs    {rep['requests']:,} requests, {rep['prompt_tokens']:,} prompt + "
            f"{rep['completion_tokens']:,} completion tokens"
        )
    if d["schema"]:
        lines.append(f"schema     {d['schema']}")
    for err in d["top_invalid"]:
        lines.append(f"invalid    {err['count']} x {err['error'][:150]}")
    if d["limit_history"]:
        moves = ", ".join(f"{limit} ({reason})" for _t, limit, reason in d["limit_history"][-8:])
        lines.append(f"limit      {d['concurrency']}: {moves}")
    for e in d["endpoints"]:
        items = ", ".join(f"{n} {s}" for s, n in e["items"].items()) or "no items yet"
        why = f" ({e['reason'][:100]})" if e.get("reason") else ""
        lines.append(
            f"endpoint   {e['name']}: {e['state']}{why}, {items}, {e['per_s']} answers/s, "
            f"{e['errors']} errors, limit {e['limit']}"
        )
    for b in d["batches"][-8:]:
        tally = b["counts"] or {}
        done = f", {tally.get('completed', 0)} completed, {tally.get('failed', 0)} failed"
        lines.append(
            f"batch      {b['chunk']} {b['id'] or '(not created)'}: {b['state']}, "
            f"{b['lines']} lines{done if tally else ''}"
        )
    for w in d["workers"][-8:]:  # the latest: a nightly job gains a worker a run
        lines.append(
            f"worker     {w['state']:7} pid {w['pid']} on {w['host']}: {w['recorded']} results, "
            f"{w['items_per_s']} items/s, heartbeat {w['heartbeat_age_s']:g} s ago"
        )
    for err in d["top_errors"]:
        if any(err == inv for inv in d["top_invalid"]):
            continue  # shown above
        lines.append(f"error      {err['count']} x {err['error'][:150]}")
    return "\n".join(lines)
