"""What a run would do now, sending nothing (`submit --no-run`): requests to send, their
tokens at most and cost, answers earlier jobs made, repeated lines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from batchrun import reuse
from batchrun.budget import Budget
from batchrun.config import RunSpec
from batchrun.inputs import estimate_tokens
from batchrun.ledger import Ledger
from batchrun.limiter import estimate_split
from batchrun.routes import endpoint_specs
from batchrun.structured import MAX_LONGER
from batchrun.validate import ERROR_CHARS, REPAIR_INSTRUCTION, load_schema, schema_of


@dataclass(frozen=True)
class Preview:
    """What a run would do now, sending nothing (`submit --no-run`)."""

    send: int  # items that would be sent
    repeated: int  # lines that would wait for an identical line's answer
    reused: int  # items an earlier job answered under the same options
    tokens: int  # estimated tokens of what would be sent: prompts + max_tokens
    cost: float | None  # at --price-in/--price-out, when given
    model_known: bool = True  # without --model, answers reused under the server's are not seen

    def said(self) -> str:
        money = f", ~{self.cost:.4f} at the prices given" if self.cost is not None else ""
        text = (
            f"would send {self.send:,} requests (~{self.tokens:,} tokens at most{money}); "
            f"{self.reused:,} answered by earlier jobs, {self.repeated:,} repeated lines "
            "answered once"
        )
        if not self.model_known:
            text += " (no --model: answers made under the model a server names are matched "
            text += "only when a run has asked it)"
        return text


def preview(ledger: Ledger, name: str, spec: RunSpec) -> Preview:
    """What running the job now would send and cost, from its stored requests. Without
    --model, reuse is matched against the model named so far (a run asks the server first)."""
    defaults = spec.request_defaults()
    job_schema = orjson.dumps(load_schema(spec.schema)) if spec.schema else None
    specs = [endpoint for _, endpoint in endpoint_specs(spec)]  # each with its own model
    keys = reuse.answer_keys(specs) if spec.reuse else None

    send, repeated, reused, (tokens_in, tokens_out) = ledger.preview(
        name,
        keys,
        reuse_since=reuse.since(spec),
        estimate=lambda body: with_follow_ups({**defaults, **body}, spec, job_schema),
    )
    tokens, cost = tokens_in + tokens_out, None
    if spec.price_in is not None or spec.price_out is not None:
        cost = Budget(price_in=spec.price_in or 0.0, price_out=spec.price_out or 0.0).cost(
            tokens_in, tokens_out
        )
    known = all(endpoint.model is not None for endpoint in specs)
    return Preview(send, repeated, reused, tokens, cost, model_known=known)


def with_follow_ups(
    body: dict[str, Any], spec: RunSpec, job_schema: bytes | None
) -> tuple[int, int]:
    """A request's tokens at most (the job's defaults under the line's `body`) with the
    follow-ups a run may send for it, as AnswerPlan sends them: each longer retry
    (--on-truncate retry-longer: the limit the run grows doubled up to the cap, after any
    answer cut short, a repair's too), and each repair with a schema, the job's or the line's
    own (the conversation again, with each answer and a note holding the error and the
    schema). Each request is priced at the longest conversation it could re-send."""
    prompt, out = estimate_split(body)
    outs = [out]
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    given = body.get(key)
    grown = given if isinstance(given, int) else out
    while spec.on_truncate == "retry-longer" and len(outs) <= MAX_LONGER:
        if grown >= spec.max_tokens_cap:
            break
        grown = min(spec.max_tokens_cap, grown * 2)
        outs.append(estimate_split({**body, key: grown})[1])
    own = schema_of(body.get("response_format"))
    schema = orjson.dumps(own) if own is not None else job_schema
    repairs = spec.repair_attempts if schema is not None else 0
    note = estimate_tokens(len(REPAIR_INSTRUCTION) + len(schema or b"") + ERROR_CHARS)
    longest = prompt + repairs * (outs[-1] + note)
    requests = len(outs) + repairs
    return requests * longest, sum(outs) + repairs * outs[-1]
