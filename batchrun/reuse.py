"""Reuse across nights: the key an answer is made under, ages given as text, and the step
before a run sends anything (`prepare`).

An earlier job's `done` answer is copied instead of sent when its request (the stored body,
as hashed at submit) and its answer options match. The options are digested here into one
`answer_spec`: the model (resolved from the server when none was given), the endpoint kind,
max_tokens, temperature, top_p, the schema (its content, not its path), and the truncation
rule; and for the in-process simulator its options, so that its synthetic answers never stand
in for a real server's of the same model name. Sampling with temperature > 0 and no seed is
reused too: a nightly rewrite wants yesterday's answer, not a new draw (`--no-reuse` is the
escape).
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from batchrun.config import ANSWER_FIELDS, RunSpec
from batchrun.errors import OptionError, UsageError
from batchrun.inputs import file_digest
from batchrun.lanes import Route
from batchrun.ledger import Joining, Ledger
from batchrun.progress import JobLog
from batchrun.routes import endpoint_specs

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")


# Stored with a job's spec by the workers that run it, so that they agree on the schema's
# content, not only its path (the same path may hold another schema on another host, or after
# an edit); the keys a worker's spec must share with the live workers' (the simulator's options
# decide its answers too).
SCHEMA_DIGEST = "schema_sha256"
# Whether its answers are made up (`--backend sim`: its options alone would let it beside a
# real server of the same model name), and the model each endpoint given by name asks.
SIMULATED = "simulated_answers"
ENDPOINT_MODELS = "endpoint_models"
ADDED = (SCHEMA_DIGEST, SIMULATED, ENDPOINT_MODELS)
SAME = (*ANSWER_FIELDS, "sim_options", *ADDED)


def answer_spec(spec: RunSpec) -> str:
    """The digest of what, beyond the request itself, decides an answer."""
    fields: dict[str, Any] = {key: getattr(spec, key) for key in ANSWER_FIELDS}
    if spec.backend == "sim":  # synthetic answers are never a real server's, whatever the model
        fields["simulated"] = spec.sim_options
    if spec.schema:
        fields["schema"] = schema_digest(spec)
    return hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)).hexdigest()


def answer_keys(specs: Iterable[RunSpec]) -> tuple[str, ...]:
    """The keys that answers made under these specs (a job's endpoints', each with its own
    model) are filed under: an earlier answer under any of them is one this job could make,
    and is reused (two endpoints serving two models: either's answer)."""
    return tuple(dict.fromkeys(answer_spec(spec) for spec in specs))


def schema_digest(spec: RunSpec) -> str | None:
    if not spec.schema:
        return None
    try:
        return file_digest(Path(spec.schema))
    except OSError as exc:
        raise UsageError(f"cannot read schema {spec.schema}: {exc.strerror}") from None


def joined(spec: RunSpec, routes: Sequence[Route] = ()) -> dict[str, Any]:
    """A run's spec as its worker stores it with the job, and as workers compare (SAME). With
    `routes`, each endpoint's model as its server named it, where none was given."""
    models = None
    if spec.endpoints:
        models = {e.name: own.model for e, own in endpoint_specs(spec)}
        models.update({route.name: route.spec.model for route in routes})
    return {
        **spec.to_json(),
        SCHEMA_DIGEST: schema_digest(spec),
        SIMULATED: True if spec.backend == "sim" else None,  # none: as a job stored before
        ENDPOINT_MODELS: models,
    }


def options(stored: dict[str, Any]) -> dict[str, Any]:
    """A job's stored spec without what `joined` added: its options."""
    return {key: value for key, value in stored.items() if key not in ADDED}


def seconds(text: str, *, key: str, unit: bool = False) -> float:
    """'7d', '12h', '30m', '90s' or a number of seconds (not with `unit`: where a wrong guess
    deletes, a bare 30 could mean days), as seconds."""
    found = AGE.fullmatch(text)
    if found and unit and not found.group(2):
        raise OptionError(
            f"{{{key}}} needs a unit, s, m, h, d or w (30d, 12h): a bare "
            f"{OptionError.quoted(text)} could mean days or seconds"
        )
    if not found:
        raise OptionError(
            f"{{{key}}} must be a number with s, m, h, d or w (7d, 12h), "
            f"got {OptionError.quoted(text)}"
        )
    return float(found.group(1)) * UNITS[found.group(2) or "s"]


def prepare(
    ledger: Ledger, name: str, spec: RunSpec, log: JobLog, joining: Joining, keys: tuple[str, ...]
) -> tuple[int, int]:
    """Before sending: repeated lines wait for their first line's answer, and earlier jobs'
    answers to the same requests under one of `keys` (answer_keys) are copied (both off with
    --no-reuse), after `joining`'s check (refused: nothing copied). (waiting, reused)."""
    started = time.perf_counter()
    chosen = keys if spec.reuse else None  # None: lines marked as repeats by a run before are sent
    found = ledger.prepare_reuse(name, chosen, reuse_since=since(spec), joining=joining)
    if not spec.reuse:
        return found
    took = round(time.perf_counter() - started, 3)
    log.event(
        "reuse", duplicates=found[0], reused=found[1], max_age=spec.reuse_max_age, seconds=took
    )
    return found


def since(spec: RunSpec) -> float | None:
    """The oldest answer --reuse-max-age lets a run reuse (None: any)."""
    age = spec.reuse_max_age
    return time.time() - seconds(age, key="reuse_max_age") if age else None
