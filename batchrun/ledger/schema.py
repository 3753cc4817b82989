"""Table definitions of the ledger (SQLAlchemy Core), shared by migrations and the store."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
    text,
)

metadata = MetaData()

# "batched": in a hosted Batch API batch (see chunks); neither claimable nor reclaimed.
STATUSES = ("pending", "running", "batched", "done", "failed", "invalid", "rejected")
FINAL_STATUSES = ("done", "failed", "invalid", "rejected")
OPEN_STATUSES = ("pending", "running", "batched")  # what a job still has to finish


def left(counts: dict[str, int]) -> int:
    """Items still to finish (pending, running, in a hosted batch)."""
    return sum(counts.get(s, 0) for s in OPEN_STATUSES)


schema_migrations = Table(
    "schema_migrations",
    metadata,
    Column("version", Integer, primary_key=True),
    Column("name", String(100), nullable=False),
    Column("applied_at", Float, nullable=False),
)

jobs = Table(
    "jobs",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("input_path", Text, nullable=False),
    Column("input_digest", String(64), nullable=False),
    Column("spec", Text, nullable=False),  # resolved RunSpec as JSON; never the API key
    Column("total", Integer, nullable=False, default=0),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float),
    # The one live runner of this job: who, where, and when it last proved it was alive.
    Column("runner_owner", String(64)),
    Column("runner_pid", Integer),
    Column("runner_host", String(255)),
    Column("runner_heartbeat", Float),
    # The adaptive concurrency's last changes, JSON [[epoch, limit, reason], ...] (migration 2).
    Column("limit_history", Text),
    # When `gc` kept only its answers for reuse (migration 10): never run or exported again.
    Column("collected_at", Float),
)

# The processes that run a job together (migration 4): each joins with a row, proves it is alive
# with its heartbeat, and leaves. Items record their worker in `items.owner`.
workers = Table(
    "workers",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("job", String(200), nullable=False, index=True),
    Column("host", String(255), nullable=False),
    Column("machine", String(64), nullable=False),  # whether its pid can be checked here
    Column("pid", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("heartbeat", Float, nullable=False),
    Column("stopped_at", Float),
    Column("recorded", Integer, nullable=False, server_default="0"),  # results it committed
    Column("requests", Integer, nullable=False, server_default="0"),
    Column("endpoints", Text),  # per endpoint: state, answered, errors, limit (migration 6)
    # Its own --lease: how long it may stay silent before others take it for gone (migration
    # 9); judged by the judge's lease instead, one worker with a short one reclaimed from all.
    Column("lease", Float),
)

items = Table(
    "items",
    metadata,
    Column("job", String(200), primary_key=True),
    Column("line", Integer, primary_key=True),
    Column("item_id", Text, nullable=False),
    Column("endpoint", String(16), nullable=False),
    Column("body", Text, nullable=False),  # the line's own request fields, JSON
    Column("digest", String(64), nullable=False),
    Column("meta", Text),
    Column("status", String(16), nullable=False),
    Column("attempts", Integer, nullable=False, default=0),
    Column("owner", String(64)),
    Column("lease_expires", Float),
    Column("latency_ms", Float),
    Column("ttft_ms", Float),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("finish_reason", String(32)),
    Column("output", Text),
    Column("parsed", Text),
    Column("error", Text),
    # What repairs of invalid answers cost, summed over runs (migration 3).
    Column("repairs", Integer, nullable=False, server_default="0"),
    Column("repair_prompt_tokens", Integer, nullable=False, server_default="0"),
    Column("repair_completion_tokens", Integer, nullable=False, server_default="0"),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    # Reuse and dedup (migration 5): the answer-shaping options a result was made under
    # (a digest; with `digest` it is what a later job's item must match to reuse it), where a
    # reused result came from, and the line whose answer a duplicate line waits for.
    Column("answer_spec", String(64)),
    Column("reused_job", String(200)),
    Column("reused_line", Integer),
    Column("dup_of", Integer),
    # Several endpoints and prefix order (migration 6): the endpoint of the item's last
    # request, and where it comes in the claim order: (first line of its prefix group << 32)
    # | line, so lines sharing a long prompt prefix are claimed together (`line << 32 | line`
    # without a group, or with --order input: input order).
    Column("answered_by", String(200)),
    Column("sched", BigInteger),
    Column("chunk", Integer),  # the hosted batch it went out in (migration 7)
    # Attempts charged against --max-attempts before a run ended without the item's result (a
    # stop, an abort): the next run goes on from there; `retry` starts it again (migration 12).
    Column("charged", Integer, nullable=False, server_default="0"),
    # The model its answer was asked of (migration 13): the line's own, its endpoint's, or
    # the job's as the run that answered it had it (a resume may name another).
    Column("answer_model", Text),  # a model named by its file path may be long
    # A batch's answer that needs a follow-up (a repair, a longer retry), JSON: the online
    # run judges it again and sends the follow-up, not the whole request (migration 7).
    Column("followup", Text),
    # Tokens paid for that no answer of the item shows (migration 8): answers that `retry` set
    # aside, and the estimates a budget charged for requests whose server reported no usage.
    Column("extra_prompt_tokens", Integer, nullable=False, server_default="0"),
    Column("extra_completion_tokens", Integer, nullable=False, server_default="0"),
    # Rows live in (job, line) order in the primary-key B-tree itself: one B-tree fewer to
    # maintain on ingest, and claims walk it as a range scan.
    sqlite_with_rowid=False,
)

# Ids are unique per job among real items; rejected lines may repeat an id (that is why they
# were rejected) and so are left out of the index. PostgreSQL's B-tree holds at most 2,704
# bytes an entry and an id (a URL, say) may be longer: there ids are unique by their md5.
items_id_unique = Index(
    "ix_items_job_item_id",
    items.c.job,
    items.c.item_id,
    unique=True,
    sqlite_where=text("status != 'rejected'"),
).ddl_if(dialect="sqlite")
items_id_digest_unique = Index(
    "ix_items_job_item_md5",
    items.c.job,
    func.md5(items.c.item_id),
    unique=True,
    postgresql_where=text("status != 'rejected'"),
).ddl_if(dialect="postgresql")

# Claims walk the pending items in claim order (partial: an item leaves it when claimed).
items_sched = Index(
    "ix_items_sched",
    items.c.job,
    items.c.sched,
    sqlite_where=text("status = 'pending'"),
    postgresql_where=text("status = 'pending'"),
)

# Reuse lookups: an earlier done result with the same request and answer options.
items_reuse = Index(
    "ix_items_reuse",
    items.c.digest,
    items.c.answer_spec,
    sqlite_where=text("status = 'done' AND answer_spec IS NOT NULL"),
    postgresql_where=text("status = 'done' AND answer_spec IS NOT NULL"),
)

# Who waits for whom (migration 5): a line that repeats an earlier line's request, found by the
# earlier line (`leader`) when its result is recorded. Its own table, keyed for that lookup.
waits = Table(
    "waits",
    metadata,
    Column("job", String(200), primary_key=True),
    Column("leader", Integer, primary_key=True),
    Column("line", Integer, primary_key=True),
)


# A job's chunks sent through a hosted Batch API (migration 7). The row is written before the
# upload (state "intent"), the file id after it, the batch id after the create, so a restart
# at any moment knows what may exist at the provider (see hosted.py).
chunks = Table(
    "chunks",
    metadata,
    Column("job", String(200), primary_key=True),
    Column("chunk", Integer, primary_key=True),
    Column("state", String(32), nullable=False),  # intent, the provider's states, collected
    # A random key, in the batch's metadata too: a batch is adopted only if it carries it
    # (another ledger's job of the same name never matches).
    Column("key", String(32), nullable=False),
    # The run uploading and creating its batch, until when (another waits, then takes over).
    Column("owner", String(64)),
    Column("lease_until", Float),
    Column("input_file", String(200)),
    Column("batch_id", String(200)),
    Column("lines", Integer, nullable=False),
    Column("counts", Text),  # the provider's request counts, JSON
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)
