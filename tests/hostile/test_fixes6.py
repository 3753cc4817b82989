"""A hostile review of the fixes of commits 3e3fc20..7d98204 (the cost review's and the fifth
review's fixes): config._moved, the --no-run preview's worst case, the requests bucket's burst,
the budget's stop, answer_model on PostgreSQL, the SQLite URL rules. Each test fails on the
code as reviewed and passes once the defect is fixed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchrun.config import resolve
from tests.hostile.test_cost import Engine, _preview_then_run, run_to_the_budget

# --- config._moved: a key variable given for the old preset's own URL ----------------------


@pytest.mark.parametrize("new", ["groq", "vllm"])
def test_a_key_variable_given_for_a_hosted_preset_does_not_follow_the_job_to_another(
    new: str,
) -> None:
    """A job run on OpenAI with its key in a variable of the user's own naming
    (`--backend openai --api-key-env WORK_OPENAI_KEY`), resumed with `--backend groq` (or a
    local `--backend vllm`): the old preset's URL goes (it was only the preset's), but
    _moved keeps the key variable because it is not the preset's own name, and resolve's
    setdefault then sends the OpenAI key to Groq's (or the vLLM box's) address. Before the
    fix both went; the README says a URL elsewhere gets the hosted key variable only "unless
    `--api-key-env` names it with the URL", and the URL moved here does the same right (a
    `--base-url` elsewhere drops the variable)."""
    stored = resolve(
        {"backend": "openai", "api_key_env": "WORK_OPENAI_KEY", "model": "gpt-4o-mini"},
        endpoint_required=False,
    ).to_json()
    assert stored["base_url"] == "https://api.openai.com/v1"
    moved = resolve(stored, {"backend": new}, endpoint_required=False)
    assert moved.base_url != "https://api.openai.com/v1"
    assert moved.api_key_env != "WORK_OPENAI_KEY", (
        f"the OpenAI key's variable WORK_OPENAI_KEY is sent to {moved.base_url} ({new})"
    )


# --- the --no-run preview's "at most" ------------------------------------------------------


def test_the_previews_worst_case_doubles_the_limit_the_run_doubles(tmp_path: Path) -> None:
    """A line's own `max_completion_tokens: 50` under --max-tokens 400 and --on-truncate
    retry-longer with --max-tokens-cap 800. vLLM obeys `max_completion_tokens` first: the
    answer is cut at 50 and the run doubles `max_completion_tokens` (structured.py
    _grow_max_tokens takes it when present): 50, 100, 200, 400, 800: five requests. The
    preview's with_follow_ups starts from the larger of the two (400) and counts one longer
    retry (800): two prompts. "At most" (the README) is then below what the run pays."""
    engine = Engine(answer=2000)
    preview, served = _preview_then_run(
        tmp_path,
        [{"prompt": "tell me a story", "max_completion_tokens": 50}],
        engine,
        max_tokens=400,
        max_tokens_cap=800,
        on_truncate="retry-longer",
    )
    assert served <= preview.tokens, (
        f"the preview said {preview.said()!r}; the run sent {engine.requests} requests and "
        f"paid {served} tokens"
    )


def test_the_previews_worst_case_counts_repairs_for_a_lines_own_schema(tmp_path: Path) -> None:
    """README: the preview's tokens at most include "each repair with a schema". A line may
    carry its own schema (`schema` or `response_format`), and the run repairs an invalid
    answer to it (structured.AnswerPlan: the line's schema or the job's), but the preview's
    with_follow_ups counts repairs only `if spec.schema` (the job's --schema): a file whose
    lines carry their schemas is previewed with no repair at all, and the run pays more."""
    engine = Engine(answer=30)  # "w w w ...": never valid JSON, so every answer is repaired
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    lines = [{"prompt": f"question {i}", "schema": schema} for i in range(3)]
    preview, served = _preview_then_run(tmp_path, lines, engine, max_tokens=40, repair_attempts=2)
    assert engine.requests == 9  # each line's ask and its two repairs
    assert served <= preview.tokens, (
        f"the preview said {preview.said()!r}; the run sent {engine.requests} requests and "
        f"paid {served} tokens"
    )


# --- the budget's stop, then a Ctrl-C ------------------------------------------------------


@pytest.mark.anyio
async def test_a_ctrl_c_during_a_budget_stops_wait_still_gives_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A budget stop now waits up to --timeout (120 s by default) for the requests it
    admitted, and says nothing while it waits. The user, seeing the run hang, presses Ctrl-C
    once: Runner.request_stop finds the stop already set and treats it as the *second*
    Ctrl-C ("stops in-flight requests at once"), so the admitted request, answered half a
    second later, is cut off: its item goes back to pending and `resume` pays for it again.
    The README gives a first Ctrl-C 10 s of grace; here it gets none."""
    import anyio

    from batchrun import jobs
    from batchrun.run_state import RunnerSettings
    from batchrun.runner import Runner

    made: list[Runner] = []

    class Kept(Runner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(jobs, "Runner", Kept)

    class CtrlCDuringTheWait(Engine):
        """Holds the slow request until the budget has stopped the run, then a Ctrl-C comes
        (as stop_on_signals delivers it), and the answer follows half a second later."""

        async def handle_async_request(self, request: Any) -> Any:
            if request.method == "POST" and b"slow" in request.content:
                while not made[0]._stopping.is_set():
                    await anyio.sleep(0.01)
                made[0].request_stop(2)  # SIGINT
                await anyio.sleep(0.5)
            return await super().handle_async_request(request)

    engine = CtrlCDuringTheWait(answer=40)
    stats, ledger = await run_to_the_budget(tmp_path, engine, RunnerSettings())
    assert stats.aborted and "--max-total-tokens 100 reached" in stats.aborted
    done = {s.item_id: s.status for s in ledger.iter_results("j")}
    assert done == {"1": "done", "2": "done", "3": "pending"}, (
        f"{done}: one Ctrl-C during the budget's wait cut off the request it had admitted "
        f"({engine.requests} answered; the ledger's paid tokens {ledger.paid_tokens('j')})"
    )


# --- the requests bucket's burst with several workers ---------------------------------------


def test_workers_sharing_a_slow_rpm_do_not_all_send_at_once() -> None:
    """--rpm 2 shared by four workers (a free-tier key, a job run from four hosts): each takes
    1/4 of the rate (limiter.Pacer.share), but the fix for --rpm 1 floors each worker's burst
    at one whole request (TokenBucket `least`), kept after share(): the four send four
    requests in the first instant, twice the minute's limit, and the provider refuses the
    extra ones. One worker alone keeps to 2 a minute; the workers together should too."""
    from batchrun.limiter import Pacer

    workers = [Pacer(rpm=2) for _ in range(4)]
    for pacer in workers:
        pacer.share(4)
    sent_in_first_minute = 0
    for pacer in workers:
        for _ in range(3):  # each has more work than the minute allows
            if pacer.wait(0.0, 10) < 60.0:
                sent_in_first_minute += 1
    alone = Pacer(rpm=2)
    alone_sent = sum(alone.wait(0.0, 10) < 60.0 for _ in range(6))
    assert alone_sent == 2
    assert sent_in_first_minute <= 2, (
        f"four workers sharing --rpm 2 sent {sent_in_first_minute} requests in the first minute"
    )


class BillsPrompts(Engine):
    """The engine, billing each prompt at batchrun's own estimate (4 characters a token of
    every message's text): the preview's "at most" is in those tokens."""

    async def handle_async_request(self, request: Any) -> Any:
        answer = await super().handle_async_request(request)
        if request.method == "POST":
            body = self.bodies[-1]
            chars = sum(len(m.get("content") or "") for m in body.get("messages", []))
            self.prompt_tokens += -(-chars // 4) - 5  # in place of the flat 5
        return answer


def test_the_previews_worst_case_counts_what_a_repair_shows_back(tmp_path: Path) -> None:
    """A repair is the conversation so far, the invalid answer and a note naming the error
    and the whole schema (validate.repair_body); a second repair carries the first's answer
    and note too. with_follow_ups counts each repair as the prompt plus one answer, so the
    notes (the schema, once per repair, and more with each one) are left out: with a schema
    of a few fields the run pays well past the preview's "at most"."""
    schema = {
        "type": "object",
        "properties": {
            name: {"type": "string", "description": f"the product's {name}, as printed"}
            for name in ("title", "brand", "colour", "material", "size", "country")
        },
        "required": ["title", "brand", "colour", "material", "size", "country"],
    }
    (tmp_path / "product.schema.json").write_text(json.dumps(schema))
    engine = BillsPrompts(answer=30)  # never valid JSON: both repairs go
    preview, served = _preview_then_run(
        tmp_path,
        [{"prompt": "describe the blue mug"}],
        engine,
        max_tokens=40,
        schema=str(tmp_path / "product.schema.json"),
        repair_attempts=2,
    )
    assert engine.requests == 3
    assert served <= preview.tokens, (
        f"the preview said {preview.said()!r}; the run sent {engine.requests} requests and "
        f"paid {served} tokens ({engine.prompt_tokens} of them prompts)"
    )


# --- an older ledger read through a read-only URI --------------------------------------------


@pytest.mark.parametrize("verb", ["status", "export"])
def test_a_ledger_made_before_migration_10_is_read_through_a_read_only_uri(
    tmp_path: Path, verb: str
) -> None:
    """README: through `...?mode=ro&uri=true` "one an older batchrun made is read at its own
    version (not migrated: that would write)". The fix (rows.stored_columns) reads items'
    missing columns as null, but the jobs table is read with every column today's schema has:
    a ledger from before migration 10 (no jobs.collected_at) fails `status` and `export`
    alike, exit 2, "no such column: jobs.collected_at (a ledger an older batchrun made,
    read-only: open it once with write access)" -- which the reader, without write access,
    cannot do."""
    import sqlite3

    from tests.hostile.test_fixes5 import _at_rest, _cli, _one_job

    home = tmp_path / "nightly"
    home.mkdir()
    db = _one_job(home)
    with sqlite3.connect(db) as conn:  # as batchrun made it before migration 10
        conn.execute("DELETE FROM schema_migrations WHERE version >= 10")
        conn.execute("ALTER TABLE items DROP COLUMN answer_model")
        conn.execute("ALTER TABLE items DROP COLUMN charged")
        conn.execute("ALTER TABLE jobs DROP COLUMN collected_at")
    conn.close()
    _at_rest(db)
    uri = f"sqlite:///file:{db}?mode=ro&uri=true"
    target = tmp_path / "copy.jsonl"
    args = ["status", "in"] if verb == "status" else ["export", "in", "-o", str(target)]
    result = _cli("--home", str(tmp_path), "--ledger", uri, *args)
    assert result.exit_code == 0, result.output
    if verb == "export":
        assert len(target.read_text().splitlines()) == 3


# --- SQLite URL rules: ?timeout= ------------------------------------------------------------


def test_a_sqlite_urls_timeout_of_inf_is_no_traceback(tmp_path: Path) -> None:
    """`?timeout=` is now the busy timeout, parsed with float() (parsed_url accepts any float)
    and then turned into milliseconds with int() in Dialect.engine: `?timeout=inf` (or
    `nan`, `1e400`) passes the check and ends every command in an OverflowError traceback."""
    from tests.hostile.test_fixes5 import _cli

    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    url = f"sqlite:///{tmp_path / 'ledger.db'}?timeout=inf"
    result = _cli(
        "--home", str(tmp_path), "--ledger", url, "submit", str(tmp_path / "in.jsonl"), "--no-run"
    )
    assert not isinstance(result.exception, (OverflowError, ValueError)), repr(result.exception)
    assert result.exit_code in (0, 2), result.output


def test_a_sqlite_urls_timeout_of_zero_is_honoured(tmp_path: Path) -> None:
    """`?timeout=0` (fail at once on a locked ledger rather than wait) is accepted and
    ignored: Dialect.engine takes `busy_ms or BUSY_TIMEOUT_MS`, and 0 is falsy, so SQLite
    waits the default 30 s -- the defect test_fixes5 found for ?timeout=60, left for 0 (and
    for anything under a millisecond)."""
    from batchrun.ledger import Ledger

    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}?timeout=0")
    with ledger.engine.connect() as conn:
        waits = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
    ledger.close()
    assert waits == 0, f"?timeout=0 accepted, but SQLite waits {waits} ms for a lock"


# --- server_metrics and several endpoints -----------------------------------------------------


def test_a_load_page_url_goes_when_a_resume_moves_the_job_to_several_endpoints() -> None:
    """README: "a URL given for one server is dropped when a resume moves the job to another
    host or backend, unless given again". A job run with --server-metrics
    http://old:8000/metrics, resumed with `--endpoint a=http://gpu1:8000/v1 --endpoint
    b=...`, moves to other hosts, but _moved only looks at base_url and backend: the URL is
    kept, and the resume is refused (exit 2, "server_metrics URL names one server; with
    several endpoints give auto or off") instead of reading each new server's page."""
    stored = {
        "backend": "vllm",
        "base_url": "http://old:8000/v1",
        "server_metrics": "http://old:8000/metrics",
    }
    moved = resolve(stored, {"endpoints": ["a=http://gpu1:8000/v1", "b=http://gpu2:8000/v1"]})
    assert moved.server_metrics == "auto"


# --- answer_model on a PostgreSQL ledger migration 13 already made ---------------------------


@pytest.mark.anyio
async def test_a_postgres_ledger_migrated_yesterday_takes_a_long_model_name(
    tmp_path: Path, postgres_server: str
) -> None:
    """The fix made migration 13's column TEXT, by editing migration 13. A PostgreSQL ledger
    that the batchrun of 3e3fc20 already migrated to version 13 keeps `answer_model
    VARCHAR(200)` (version 13 is recorded, so nothing runs again), and the defect the fix was
    for stays on every such ledger: a line asking a model named by its 229-character path
    makes the group commit fail and the run abort, at every resume."""
    import sqlalchemy

    from batchrun.ledger import Ledger
    from tests.hostile.test_fixes5 import run_sim_job
    from tests.postgres import fresh_database

    long_model = "/srv/models/" + "snapshots/" * 20 + "model-Q4_K_M.gguf"  # 229 characters
    rows = [{"id": "a", "prompt": "p0"}, {"id": "b", "prompt": "p1", "model": long_model}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with fresh_database(postgres_server) as url:
        made = Ledger(url)  # migrated to 13; then as yesterday's migration 13 made the column
        with made.engine.begin() as conn:
            conn.execute(
                sqlalchemy.text("ALTER TABLE items ALTER COLUMN answer_model TYPE VARCHAR(200)")
            )
            # version 13 was the newest then: the widening (migration 14) has yet to run
            conn.execute(sqlalchemy.text("DELETE FROM schema_migrations WHERE version > 13"))
        made.close()
        stats, counts = await run_sim_job(tmp_path, url)  # today's batchrun opens it
    assert stats.aborted is None, stats.aborted
    assert counts["pending"] == 0 and counts["running"] == 0, counts


# --- the budget's message ---------------------------------------------------------------------


def test_a_cost_budgets_message_shows_what_is_in_flight() -> None:
    """The fix makes a --max-cost stop name the cost's limit, but its words leave out what is
    in flight (the token budget's say it): with 3 requests of $3 admitted and on the wire, the
    fourth is refused with "--max-cost 10 reached: 0.0000 spent, the next request may cost
    3.0000" -- 0 + 3 is well under 10, and the user cannot tell why the job stopped, nor how
    far to raise it."""
    from batchrun.budget import Budget, BudgetReached

    budget = Budget(max_cost=10.0, price_in=1_000_000.0, price_out=1_000_000.0)  # $1 a token
    for _ in range(3):
        budget.admit(1, 2)  # $3 each, in flight
    with pytest.raises(BudgetReached) as refused:
        budget.admit(1, 2)
    said = str(refused.value)
    assert "--max-cost 10" in said
    assert "in flight" in said and "9.0000" in said, said


def test_a_cost_budgets_message_does_not_round_the_next_request_to_nothing() -> None:
    """A cheap model (a hosted small model at $0.05 and $0.20 per million tokens) under
    --max-cost 0.0001: the request refused "may cost 0.0000" (`:.4f`), and what was spent is
    "0.0001" against a limit of 0.0001: the figures the message gives cannot show why the
    request was refused."""
    from batchrun.budget import Budget, BudgetReached

    budget = Budget(max_cost=0.0001, price_in=0.05, price_out=0.20, spent_in=1000, spent_out=220)
    with pytest.raises(BudgetReached) as refused:
        budget.admit(20, 40)  # $0.000009
    said = str(refused.value)
    assert "may cost 0.0000" not in said, said


# --- today's new option rules, applied to a job stored yesterday -------------------------------


@pytest.mark.parametrize(
    "stored_as",
    [
        {"on_truncate": "retry-longer", "max_tokens": 4096, "max_tokens_cap": 4096},
        {"temperature": -0.5},
    ],
    ids=["retry-longer-at-the-cap", "negative-temperature"],
)
def test_export_of_a_job_stored_before_the_new_option_rules(
    tmp_path: Path, stored_as: dict[str, Any]
) -> None:
    """Commit 8ddf32b refuses `--on-truncate retry-longer` with a --max-tokens at or above
    --max-tokens-cap (4096 by default: `--max-tokens 4096 --on-truncate retry-longer` was
    accepted until today) and a negative temperature. spec_rules.validate applies them to a
    stored spec too (stored=True, the very path test_fixes5 fixed for --max-cost with one
    price), so `export` of such a job -- finished, nothing to send, export takes no run
    options -- is refused, exit 2: "--max-tokens-cap must be above --max-tokens to retry
    longer". Its results cannot be written again."""
    from tests.hostile.test_fixes5 import _one_job, stored_then_exported

    home = tmp_path / "h"
    home.mkdir()
    db = _one_job(home, max_tokens=20)  # then as yesterday's batchrun stored it:
    result, target = stored_then_exported(home, db, stored_as, tmp_path / "again.jsonl")
    assert result.exit_code == 0, result.output
    assert len(target.read_text().splitlines()) == 3
