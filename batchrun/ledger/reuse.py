"""Answers reused instead of sent: from earlier jobs, and within a job for duplicate lines.

The key is the request as stored (`digest`: the body with the submit-time defaults), the
endpoint kind, and `answer_spec`, a digest of the options that change an answer (model,
sampling, schema...) under which a result was made. The runner computes `answer_spec` for its
run (`batchrun/reuse.py`); every result it records carries it.

- Reuse: a pending item whose key matches a `done` result of another job (made recently
  enough) gets that result copied, with `reused_job`/`reused_line` saying where from. Nothing
  is sent. Only answers that a request made are sources (a copy carries no `answer_spec`), so
  an age limit is the answer's own age, however many nights reused it.
- Dedup: pending lines of one job with the same request wait for the first of them
  (`dup_of`); claims pass them over, and the first one's result is copied to them when it is
  recorded (`fan_out`, in the same transaction).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import orjson
from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    delete,
    exists,
    func,
    literal,
    select,
    update,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.expression import FromClause

from batchrun.ledger.records import ItemResult
from batchrun.ledger.schema import FINAL_STATUSES, items
from batchrun.ledger.schema import waits as waiting

# The answer specs (reuse.py's keys) an earlier answer may have been made under: one, or a
# job's endpoints' (each with its own model).
Keys = str | tuple[str, ...]
# What a reused or fanned-out line takes from the answer it copies.
COPIED = (
    "status",
    "output",
    "parsed",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "latency_ms",
    "ttft_ms",
    "error",
    "answered_by",
    "answer_model",
)
# A copy is not a source: it is not an answer a request made, whatever the row held before (a
# line that once failed under other options keeps their `answer_spec` until it is done again).
NOT_A_SOURCE: dict[str, Any] = {"answer_spec": None}


# Rows read at a time, and written per statement, where a job's lines are looked over: a pass
# keeps the line before and the repeats it found, not every line's key (a million lines' keys
# in a dict took 250 MB).
WRITE_BATCH = 10_000


def mark_duplicates(conn: Connection, job: str) -> int:
    """Pending lines whose request an earlier pending line of the job also sends wait for
    it; how many lines now wait. The lines are read in request order, so a request's lines
    come together and only the one before is kept; the repeats are written as they are found,
    WRITE_BATCH at a time. (The writes do not disturb the read: SQLite sorts every row before
    the first comes back, and a PostgreSQL cursor sees the rows as they were when opened.)"""
    query = (
        select(items.c.line, items.c.endpoint, items.c.digest)
        .where(items.c.job == job, items.c.status == "pending", items.c.dup_of.is_(None))
        .order_by(items.c.endpoint, items.c.digest, items.c.line)
        .execution_options(yield_per=WRITE_BATCH)  # a server-side cursor on PostgreSQL
    )
    key: tuple[str, str] | None = None
    leader = marked = 0
    waits: list[tuple[int, int]] = []  # (line, the line it waits for)
    for line, endpoint, digest in conn.execute(query):
        if (endpoint, digest) != key:
            key, leader = (endpoint, digest), line
            continue
        waits.append((line, leader))
        if len(waits) == WRITE_BATCH:
            marked += _wait(conn, job, waits)
            waits = []
    return marked + _wait(conn, job, waits)


def _wait(conn: Connection, job: str, waits: list[tuple[int, int]]) -> int:
    """These lines wait for those: (line, leader) pairs. How many."""
    if waits:
        conn.execute(
            update(items)
            .where(items.c.job == job, items.c.line == bindparam("l"))
            .values(dup_of=bindparam("leader")),
            [{"l": line, "leader": leader} for line, leader in waits],
        )
        rows = [{"job": job, "leader": leader, "line": line} for line, leader in waits]
        conn.execute(waiting.insert(), rows)
    return len(waits)


def forget_duplicates(conn: Connection, job: str) -> int:
    """Pending lines that wait for another line's answer wait no more (--no-reuse: each is
    sent); how many."""
    marked = and_(items.c.job == job, items.c.status == "pending", items.c.dup_of.is_not(None))
    conn.execute(
        delete(waiting).where(
            waiting.c.job == job, waiting.c.line.in_(select(items.c.line).where(marked))
        )
    )
    return int(conn.execute(update(items).where(marked).values(dup_of=None)).rowcount)


def still_waiting(conn: Connection, job: str) -> int:
    """Lines that wait for another line's answer (and were not answered by an earlier job)."""
    query = (
        select(func.count())
        .select_from(waiting)
        .join(items, and_(items.c.job == waiting.c.job, items.c.line == waiting.c.line))
    )
    return int(
        conn.execute(query.where(waiting.c.job == job, items.c.status == "pending")).scalar() or 0
    )


def waiting_on(conn: Connection, job: str) -> tuple[bool, bool]:
    """Of the pending lines that wait for another line's answer: whether one waits for a line
    already final (a stray: see settle_strays), and whether one waits for a line still to be
    answered here (pending or running; not one at a hosted batch, which no online run ends).
    A read, driven by the waiting lines."""
    leader = items.alias("leader")
    waits = and_(
        items.c.job == job,
        items.c.status == "pending",
        items.c.dup_of.is_not(None),
        leader.c.job == job,
        leader.c.line == items.c.dup_of,
    )
    stray = exists().where(waits, leader.c.status.in_(FINAL_STATUSES))
    coming = exists().where(waits, leader.c.status.in_(("pending", "running")))
    found = conn.execute(select(stray, coming)).one()
    return bool(found[0]), bool(found[1])


def settle_strays(conn: Connection, job: str, now: float) -> int:
    """Pending lines whose leader is final get its answer; how many. fan_out gives it as the
    leader's answer is recorded, but on PostgreSQL a run marking repeats (mark_duplicates)
    can commit after another worker recorded a leader it had read as pending: that record's
    fan_out saw no line waiting, and the line would wait for ever. Run when nothing is left
    to claim (Ledger.more_may_come), so no such line is left waiting."""
    leader = items.alias("leader")
    copy = (
        update(items)
        .where(items.c.job == job, items.c.status == "pending", items.c.dup_of.is_not(None))
        .where(leader.c.job == job, leader.c.line == items.c.dup_of)
        .where(leader.c.status.in_(FINAL_STATUSES))
        .values(updated_at=now, **NOT_A_SOURCE, **{c: leader.c[c] for c in COPIED})
    )
    return int(conn.execute(copy).rowcount)


def _answered_before(
    me: FromClause, src: FromClause, job: str, keys: Keys, since: float | None
) -> ColumnElement[bool]:
    """`src` is an earlier job's answer to `me`'s request under one of `keys` (answer specs):
    what reuse matches (the index on (digest, answer_spec) holds exactly the done answers)."""
    keys = (keys,) if isinstance(keys, str) else keys
    match = and_(
        src.c.digest == me.c.digest,
        src.c.answer_spec == keys[0] if len(keys) == 1 else src.c.answer_spec.in_(keys),
        src.c.status == "done",
        src.c.endpoint == me.c.endpoint,
        src.c.job != job,
    )
    return match if since is None else and_(match, src.c.updated_at >= since)


def reuse_earlier(
    conn: Connection, job: str, keys: Keys, *, since: float | None, now: float
) -> int:
    """Copy earlier jobs' done results onto this job's pending items with the same request
    and answer options (made at `since` or later); how many items were answered. One
    UPDATE ... FROM (SQLite 3.33+, PostgreSQL): the join runs in the database, each pending
    item probing the (digest, answer_spec) index once; of several matches, any one serves."""
    me, src = items.alias("me"), items.alias("src")
    match = _answered_before(me, src, job, keys, since)
    found = (
        select(
            me.c.line.label("l"),
            src.c.job.label("rj"),
            src.c.line.label("rl"),
            *(src.c[c].label(c) for c in COPIED),
        )
        .join(src, match)
        .where(me.c.job == job, me.c.status == "pending")
        .subquery("found")
    )
    copy = (
        update(items)
        .where(items.c.job == job, items.c.line == found.c.l, items.c.status == "pending")
        .values(
            reused_job=found.c.rj,
            reused_line=found.c.rl,
            updated_at=now,
            **NOT_A_SOURCE,
            **{c: found.c[c] for c in COPIED},
        )
    )
    return int(conn.execute(copy).rowcount)


def fan_out(conn: Connection, job: str, committed: list[ItemResult], now: float) -> Counter[str]:
    """The lines waiting for these results (the ones this transaction committed) get them; how
    many, by the status they took. One key lookup when no line of the group has lines waiting
    for it, and a statement for each status that has."""
    by_line = {r.line: r for r in committed}
    followers = conn.execute(
        select(waiting.c.line, waiting.c.leader).where(
            waiting.c.job == job, waiting.c.leader.in_(by_line)
        )
    ).all()
    copy = (
        update(items)
        .where(items.c.job == job, items.c.line == bindparam("l"), items.c.status == "pending")
        .values(updated_at=now, **NOT_A_SOURCE, **{c: bindparam(f"c_{c}") for c in COPIED})
    )
    by_status: dict[str, list[dict[str, Any]]] = {}
    for line, leader in followers:
        answer = by_line[leader]
        row = {"l": line} | {f"c_{c}": getattr(answer, c) for c in COPIED}
        by_status.setdefault(answer.status, []).append(row)
    return Counter(
        {status: int(conn.execute(copy, rows).rowcount) for status, rows in by_status.items()}
    )


def finished(
    conn: Connection, job: str, results: list[ItemResult], changed: int, now: float
) -> dict[str, int]:
    """The items a commit at `now` of `results` finished (`changed` of their rows), by status:
    the lines waiting for them get them too. Where a guard turned some results away (late, or
    not under their lease), their rows say which were written."""
    if changed < len(results):
        lines = [r.line for r in results]
        written = set(
            conn.execute(
                select(items.c.line).where(
                    items.c.job == job, items.c.line.in_(lines), items.c.updated_at == now
                )
            ).scalars()
        )
        results = [r for r in results if r.line in written]
    by_status = Counter(r.status for r in results)
    by_status.update(fan_out(conn, job, results, now))
    return dict(by_status)


def preview(
    conn: Connection,
    job: str,
    keys: Keys | None,
    *,
    since: float | None,
    estimate: Callable[[dict[str, Any]], tuple[int, int]],
) -> tuple[int, int, int, tuple[int, int]]:
    """What a run would do now, sending nothing: (items to send, repeated lines answered
    once, items an earlier job answered, estimated prompt and output tokens of what would be
    sent).
    `keys` None: nothing is reused or deduplicated (--no-reuse)."""
    src = items.alias("src")
    match = _answered_before(items, src, job, keys or "", since)
    answered = exists().where(match) if keys else literal(False)
    # In request order, so that a request's lines come together: only the one before is kept.
    query = (
        select(items.c.endpoint, items.c.digest, items.c.body, answered)
        # running too: a run's claims, sent by it, or by the next if it is gone (kill -9)
        .where(items.c.job == job, items.c.status.in_(("pending", "running")))
        .order_by(items.c.endpoint, items.c.digest, items.c.line)
        .execution_options(yield_per=WRITE_BATCH)
    )
    key: tuple[str, str] | None = None
    first = False  # whether the request's first line would be reused
    send = repeated = reused = tokens_in = tokens_out = 0
    for endpoint, digest, body, earlier in conn.execute(query):
        if keys and (endpoint, digest) == key:
            reused += first
            repeated += not first
            continue
        key, first = (endpoint, digest), bool(earlier)
        if earlier:
            reused += 1
        else:
            send += 1
            est_in, est_out = estimate(orjson.loads(body))
            tokens_in, tokens_out = tokens_in + est_in, tokens_out + est_out
    return send, repeated, reused, (tokens_in, tokens_out)
