"""A hostile review of the fixes of commits 7d98204..599a350 (tests/hostile/test_fixes6.py's):
config._moved, the --no-run preview's worst case, readable_columns, the SQLite URL's
?timeout=, the shared --rpm burst, validate(stored=True). Each test fails on the code as reviewed
and passes once the defect is fixed."""

from __future__ import annotations

from typing import Any

import pytest

from batchrun.config import resolve

# --- config._moved: a job loaded with several endpoints, moved to a hosted preset -------------


@pytest.mark.parametrize("new", ["groq", "openai"])
def test_a_job_with_several_endpoints_resumed_on_a_hosted_preset_goes_there(new: str) -> None:
    """`submit --endpoint a=http://10.0.0.5:8000/v1 --endpoint b=... --no-run`, then
    `resume JOB --backend groq`: the stored spec holds base_url = the first endpoint's URL
    (resolve sets it "for messages") and backend custom. _moved sees a switch from custom,
    whose preset URL is "", so it keeps that URL as if the user had given it; the endpoints
    go (a backend replaces them). The job runs as `groq` at 10.0.0.5 with GROQ_API_KEY: the
    Groq key is sent to a private box, and Groq is never asked. Given in one command
    (endpoints then --backend groq) the same options go to Groq's own URL."""
    stored = resolve(
        {"endpoints": ["a=http://10.0.0.5:8000/v1", "b=http://10.0.0.6:8000/v1"], "model": "m"},
        endpoint_required=False,
    ).to_json()
    moved = resolve(stored, {"backend": new}, endpoint_required=False)
    at_once = resolve(
        {"endpoints": ["a=http://10.0.0.5:8000/v1", "b=http://10.0.0.6:8000/v1"], "model": "m"},
        {"backend": new},
        endpoint_required=False,
    )
    assert (moved.base_url, moved.api_key_env) == (at_once.base_url, at_once.api_key_env), (
        f"resumed with --backend {new}, the job goes to {moved.base_url} carrying "
        f"{moved.api_key_env}"
    )


# --- the --no-run preview's worst case: a repair's answer cut short, then grown ---------------


def _plan_tokens(
    spec: Any, body: dict[str, Any], answers: list[tuple[str, str, int]]
) -> tuple[int, int]:
    """Drive AnswerPlan as a run does (the sender's loop) with scripted answers, adding up
    the same estimate the preview makes of every request it asks to send."""
    from batchrun.backends.base import Completion
    from batchrun.limiter import estimate_split
    from batchrun.structured import OutputRules
    from batchrun.validate import load_schema

    rules = OutputRules(
        schema=load_schema(spec.schema),
        repair_attempts=spec.repair_attempts,
        retry_longer=spec.on_truncate == "retry-longer",
        max_tokens_cap=spec.max_tokens_cap,
    )
    plan = rules.plan("chat", body)
    total_in = total_out = 0
    for text, finish, used in answers:
        est_in, est_out = estimate_split(plan.request())
        total_in, total_out = total_in + est_in, total_out + est_out
        outcome = plan.judge(Completion(text, finish, est_in, used, 0.1, None))
        if outcome is not None:
            break
    else:
        raise AssertionError("the scripted answers did not end the item")
    return total_in, total_out


def test_the_preview_worst_case_holds_a_repair_cut_short_and_grown(tmp_path: Any) -> None:
    """README: `submit --no-run` says the tokens "at most" with "every follow-up a run may
    send: each longer retry up to --max-tokens-cap ..., each repair with a schema ..., the
    conversation growing with each". with_follow_ups counts the longer retries at the bare
    prompt, then the repairs. But AnswerPlan grows max_tokens on *any* answer cut short,
    a repair's too: the first answer is invalid (stop), the repair's answer hits the limit,
    and each longer retry re-sends the whole repair conversation (prompt + answer + a note
    holding the schema). With a large schema that sends far more than the "at most"."""
    import orjson

    from batchrun.preview import with_follow_ups

    schema = {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "string", "description": "a long description " * 5}
            for i in range(40)
        },
        "required": ["field_0"],
    }
    path = tmp_path / "schema.json"
    path.write_bytes(orjson.dumps(schema))
    spec = resolve(
        {
            "backend": "sim",
            "model": "sim-1",
            "schema": str(path),
            "repair_attempts": 1,
            "on_truncate": "retry-longer",
            "max_tokens": 100,
            "max_tokens_cap": 400,
        }
    )
    body = {**spec.request_defaults(), "messages": [{"role": "user", "content": "q" * 400}]}
    preview_in, preview_out = with_follow_ups(body, spec, orjson.dumps(schema))
    bad = "x" * 400  # 100 tokens at 4 characters each: not JSON
    sent_in, sent_out = _plan_tokens(
        spec,
        body,
        [
            (bad, "stop", 100),  # invalid: a repair
            (bad, "length", 100),  # the repair's answer cut short: max_tokens 200
            (bad, "length", 200),  # again: 400 (the cap)
            (bad, "stop", 400),  # still invalid, no repairs left: the item ends
        ],
    )
    assert sent_in + sent_out <= preview_in + preview_out, (
        f"the preview says at most {preview_in + preview_out:,} tokens "
        f"({preview_in:,} in), the run sends {sent_in + sent_out:,} ({sent_in:,} in)"
    )


# --- an older ledger read through a read-only URI: every table, not only jobs and items -----


@pytest.mark.parametrize(
    ("before", "args"),
    [
        (9, ["status"]),  # workers.lease (migration 9): "listing workers"
        (8, ["status", "in"]),  # items.extra_*_tokens (migration 8): "reading stats"
    ],
)
def test_status_reads_an_older_ledger_through_a_read_only_uri(
    tmp_path: Any, before: int, args: list[str]
) -> None:
    """README: through `...?mode=ro&uri=true` `status` and `export` read a ledger, and "one
    an older batchrun made is read at its own version (not migrated: that would write)". The
    fix (rows.readable_columns) covers the jobs table and the items columns `export` reads;
    `status` also lists workers (every column of today's workers table: lease came with
    migration 9) and reads a job's stats (items.extra_prompt_tokens, migration 8). Either
    ends in exit 2, "no such column ... (a ledger an older batchrun made, read-only: open it
    once with write access)", which a reader without write access cannot do."""
    import sqlite3

    from tests.hostile.test_fixes5 import _at_rest, _cli, _one_job

    home = tmp_path / "nightly"
    home.mkdir()
    db = _one_job(home)
    with sqlite3.connect(db) as conn:  # as batchrun made it before migration `before`
        conn.execute("DELETE FROM schema_migrations WHERE version >= ?", (before,))
        for column in ("answer_model", "charged"):
            conn.execute(f"ALTER TABLE items DROP COLUMN {column}")
        conn.execute("ALTER TABLE jobs DROP COLUMN collected_at")
        conn.execute("ALTER TABLE workers DROP COLUMN lease")
        if before <= 8:
            for column in ("extra_prompt_tokens", "extra_completion_tokens"):
                conn.execute(f"ALTER TABLE items DROP COLUMN {column}")
    conn.close()
    _at_rest(db)
    uri = f"sqlite:///file:{db}?mode=ro&uri=true"
    result = _cli("--home", str(tmp_path), "--ledger", uri, *args)
    assert result.exit_code == 0, result.output


# --- SQLite URL rules: a long ?timeout= ------------------------------------------------------


def test_a_sqlite_urls_timeout_of_thirty_days_does_not_fail_at_once(tmp_path: Any) -> None:
    """README: `?timeout=S` sets the busy timeout, "0 fails at once on a locked ledger; a
    value that is not a finite number of seconds is refused". parsed_url now accepts up to a
    year, but Dialect.engine passes milliseconds to `PRAGMA busy_timeout`, a 32-bit int in
    SQLite: past 2**31-1 ms (about 24.8 days) SQLite reads it as 0. `?timeout=2592000` (30
    days: "wait, however long") is accepted and then fails at once on a locked ledger,
    the opposite of what was asked."""
    from batchrun.errors import LedgerError
    from batchrun.ledger import Ledger

    try:
        ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}?timeout=2592000")
    except LedgerError:
        return  # refused, said: fine
    with ledger.engine.connect() as conn:
        waits = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
    ledger.close()
    assert waits >= 60_000, f"?timeout=2592000 accepted, but SQLite waits {waits} ms for a lock"


# --- spec_rules.validate(stored=True): a rule added since still locks a stored job ------------


@pytest.mark.parametrize("budget", ["max_total_tokens", "max_cost"])
def test_a_job_stored_with_a_budget_and_no_max_tokens_is_exported(
    tmp_path: Any, budget: str
) -> None:
    """Commit 1dac006: "A job's stored spec is read back (export, cancel) whatever rules came
    since". The rule "{max_total_tokens}/{max_cost} needs {max_tokens}" came on 4 December
    (ab43f85); a job loaded before it with `--max-total-tokens 100000` and no --max-tokens
    (or --max-cost with both prices) is still checked by validate(stored=True), and
    `export` ends in exit 2 "--max-total-tokens needs --max-tokens ...": its answers, paid
    for, cannot be read out without first changing options a read does not take."""
    from tests.hostile.test_fixes5 import _one_job, stored_then_exported

    db = _one_job(tmp_path)  # then as a batchrun before ab43f85 stored it:
    older = {"max_tokens": None, budget: 100000 if budget == "max_total_tokens" else 5.0}
    older.update({"price_in": 1.0, "price_out": 2.0})
    result, target = stored_then_exported(tmp_path, db, older, tmp_path / "out.jsonl")
    assert result.exit_code == 0, result.output
    assert len(target.read_text().splitlines()) == 3
