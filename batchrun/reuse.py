"""Reuse across nights: the key an answer is made under, and ages given as text.

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
from pathlib import Path
from typing import Any

import orjson

from batchrun.config import ANSWER_FIELDS, RunSpec
from batchrun.errors import OptionError, UsageError

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")


def answer_spec(spec: RunSpec) -> str:
    """The digest of what, beyond the request itself, decides an answer."""
    fields: dict[str, Any] = {key: getattr(spec, key) for key in ANSWER_FIELDS}
    if spec.backend == "sim":  # synthetic answers are never a real server's, whatever the model
        fields["simulated"] = spec.sim_options
    if spec.schema:
        try:
            fields["schema"] = hashlib.sha256(Path(spec.schema).read_bytes()).hexdigest()
        except OSError as exc:
            raise UsageError(f"cannot read schema {spec.schema}: {exc.strerror}") from None
    return hashlib.sha256(orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)).hexdigest()


def seconds(text: str, *, key: str) -> float:
    """'7d', '12h', '30m', '90s' or a number of seconds, as seconds."""
    found = AGE.fullmatch(text)
    if not found:
        raise OptionError(
            f"{{{key}}} must be a number with s, m, h, d or w (7d, 12h), "
            f"got {OptionError.quoted(text)}"
        )
    return float(found.group(1)) * UNITS[found.group(2) or "s"]
