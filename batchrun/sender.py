"""One item, from its claim to its result: pacing, retries, and the structured-output loop.

Each request is paced (rate limits, adaptive concurrency), retried on transient errors by the
retry policy, and logged as an `attempt`. Its answer goes to the item's AnswerPlan, which may
ask for another request: a repair follow-up, a longer max_tokens, or the same request without
`response_format` when the server refused that with a 400 (then guidance stays off for the run,
said once in the log).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from batchrun.backends import Completion, CompletionRequest
from batchrun.budget import BudgetReached
from batchrun.errors import BadRequest, FatalError, NotFound, PermanentError, RequestError
from batchrun.fleet import Fleet, Rerouted
from batchrun.inputs import estimate_tokens
from batchrun.lanes import Lane
from batchrun.ledger import ClaimedItem, ItemResult, Spent
from batchrun.limiter import estimate_split
from batchrun.progress import JobLog, input_summary
from batchrun.retrying import RetryPolicy, Tally
from batchrun.reuse import answer_spec
from batchrun.routes import named_model
from batchrun.run_state import RunnerSettings, RunStats
from batchrun.structured import AnswerPlan, Outcome, OutputRules


class Sender:
    def __init__(
        self,
        fleet: Fleet,
        *,
        policy: RetryPolicy,
        rules: OutputRules,
        defaults: dict[str, Any],
        log: JobLog,
        stats: RunStats,
        settings: RunnerSettings,
        on_fatal: Callable[[FatalError], None],
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.rules = rules
        # With several endpoints each adds its own model at send time (a line's own wins).
        self.defaults = (
            defaults if fleet.only else {k: v for k, v in defaults.items() if k != "model"}
        )
        self.log = log
        self.stats = stats
        self.settings = settings
        self._fatal = on_fatal
        self._warming: dict[int, Lead] = {}  # a group's first line, while its request is on
        self.warm_groups = True  # a group's later lines wait for its first (prefix order)
        # The run's stop: a request not yet sent by then is not sent (the runner's own event).
        self.stopping = anyio.Event()
        # Whether this worker still holds a line, as it is about to send it (the feeder's
        # still_held: a worker frozen past its lease may have lost its lines to others).
        self.holds: Callable[[ClaimedItem], Awaitable[bool]] | None = None
        # Items this run ends without a result for, and what it spent on them: stored as they
        # go back to pending, so attempts and --max-attempts go on at the next run.
        self.spent: list[Spent] = []

    async def process(self, item: ClaimedItem) -> ItemResult | None:
        """The item's final result; None when a fatal error or a stop ended the run meanwhile
        (the item stays leased; the run's end puts it back to pending).

        A prefix group's later lines wait until its first line's request has its first token
        (or has ended), if that request is under way here: the engine then computes the
        shared prefix once and the rest find it cached, instead of a whole wave of requests
        each computing it cold at once (llama-server's slots do not share their caches).
        With several endpoints only the lines sent where the first line went wait, holding
        their slots there: the others go elsewhere at once, and a first line that hangs
        holds up only the slots its group would have used on that endpoint."""
        try:
            if not self.warm_groups:
                return await self._process(item, None, None)
            if item.group is not None and item.group != item.line:
                first = self._warming.get(item.group)
                if first is not None and self.fleet.only is not None:
                    await first.done.wait()  # one endpoint: before a slot is taken
                    first = None
                return await self._process(item, None, first)
            warm = self._warming[item.line] = Lead()  # maybe a group's first line
            try:
                return await self._process(item, warm, None)
            finally:
                warm.done.set()
                del self._warming[item.line]
        except _Stopped:
            return None
        finally:
            if self.fleet.only is None:
                self.fleet.forget(item.line)

    async def _process(
        self, item: ClaimedItem, warm: Lead | None, first: Lead | None
    ) -> ItemResult | None:
        body = {**self.defaults, **item.body}
        plan = self.rules.plan(item.endpoint, body)
        summary = None if self.log.redact else input_summary(body)
        attempts = tries = sent_here = 0  # sent_here: requests that went out
        tally = Tally(item.charged)  # charged against --max-attempts, earlier runs' included
        refusal: str | None = None  # a 400 to the guided request, until unguided succeeds
        guided = False  # whether the latest request carried response_format
        fleet = self.fleet
        lane = fleet.lanes[0]  # the latest request's endpoint

        def log_attempt(status: str, **fields: Any) -> None:
            number = item.attempts + attempts
            if fleet.only is None:
                fields["endpoint"] = lane.name
            self.log.attempt(
                item_id=item.item_id,
                line=item.line,
                digest=item.digest,
                summary=summary,
                attempt=number,
                status=status,
                **fields,
            )

        def asked_again(whys: tuple[str, ...]) -> None:
            """The attempt asked more than once (an empty stream, a refused stream_options):
            each ask before the last is a request of its own, counted and logged (not
            charged: one attempt)."""
            nonlocal attempts, sent_here
            for why in whys:
                log_attempt("error", error=why)
                attempts += 1
                sent_here += 1
                self.stats.requests += 1

        async def attempt() -> Completion:
            nonlocal attempts, tries, guided, lane
            attempts += 1
            tries += 1
            guided = plan.guided
            if fleet.only is not None:
                try:
                    return await send(fleet.only)
                except RequestError as exc:
                    fleet.ended(fleet.only, item.line, exc)
                    raise
            lane = await fleet.pick(item.line, item.group)
            try:
                completion = await send(lane)
            except BaseException as exc:
                fleet.ended(lane, item.line, exc)
                raise
            fleet.ended(lane, item.line, None)
            return completion

        async def send(lane: Lane) -> Completion:
            nonlocal sent_here
            body = self._body(plan.request(lane.route.guided_style), lane, item)
            request = CompletionRequest(item.endpoint, body)
            prompt, most = estimate_split(request.body)
            taken = lane is not fleet.only
            if warm is not None:
                warm.lane = lane
            after = first.done if first is not None and first.lane is lane else None
            estimate = prompt + most
            async with lane.throttle.slot(
                estimate, prompt_tokens=prompt, taken=taken, after=after
            ) as slot:
                if self.stopping.is_set():  # it waited for its slot, or to retry, past a stop
                    raise _Stopped("the run was stopped before this request was sent")
                if self.holds is not None and not await self.holds(item):
                    raise _Stopped("another worker holds it now: this one was taken for gone")
                if lane.route.waiting:  # away as the job started: this probe asks its model first
                    await self._ask_model(lane)
                    request = CompletionRequest(item.endpoint, self._body(request.body, lane, item))
                slot.warm = warm.done if warm is not None else None  # first token: the rest go
                # Counted when sent (every request sent gets its attempt line); a retry is the
                # same request again (repairs are new requests, not retries).
                self.stats.requests += 1
                sent_here += 1
                if tries > 1:
                    self.stats.retries += 1
                sent = time.perf_counter()
                try:
                    completion = await lane.backend.complete(request, watch=slot)
                except RequestError as exc:
                    slot.failed(exc)
                    asked_again(exc.asked_again)
                    took = _ms(time.perf_counter() - sent)
                    why = {"error_kind": type(exc).__name__, "error": str(exc)}
                    log_attempt("error", http_status=exc.status, latency_ms=took, **why)
                    # a 404 to the line's own model or API kind is that line's, not the endpoint's
                    own = isinstance(exc, NotFound) and _asked_itself(item, lane)
                    if isinstance(exc, FatalError) and not own and fleet.take_out(lane, exc):
                        raise Rerouted(f"{lane.name} left the job: {exc}") from None
                    if (own or isinstance(exc, BadRequest)) and fleet.only is None:
                        if fleet.refused(lane, item.line, exc):  # another endpoint may take it
                            raise Rerouted(f"{lane.name} refused it: {exc}") from None
                        if own:  # every endpoint refused the line: it fails, not the job
                            raise PermanentError(str(exc)) from None
                    if own and (fleet.left_out or self._not_the_jobs(item, lane)):
                        raise PermanentError(str(exc)) from None  # that line's: it fails
                    raise
                except anyio.get_cancelled_exc_class():  # a second Ctrl-C: stopped unanswered
                    log_attempt("cancelled", error="the run was stopped before the answer came")
                    raise
                # a server without usage still shows its throughput through the text length
                tokens = completion.completion_tokens or estimate_tokens(len(completion.text))
                slot.done(completion, tokens)
                if completion.completion_tokens is None:  # charged as estimates: kept as paid
                    plan.estimated = (plan.estimated[0] + prompt, plan.estimated[1] + tokens)
            asked_again(completion.asked_again)
            log_attempt(
                "ok",
                http_status=completion.http_status,
                latency_ms=_ms(completion.latency_s),
                ttft_ms=_ms(completion.ttft_s),
                prompt_tokens=completion.prompt_tokens,
                completion_tokens=completion.completion_tokens,
                finish_reason=completion.finish_reason,
            )
            return completion

        if item.previous is not None:  # a hosted batch's answer: judged first, then followed
            answered = _completion_of(item.previous)
            outcome = plan.judge(answered)
            if outcome is not None:  # judged well now (a schema changed since, say)
                return self._result(item, attempts, answered, outcome, plan, lane)
        while True:
            tries = 0
            try:
                completion = await self.policy.call(attempt, key=item.line, tally=tally)
            except (FatalError, _Stopped) as exc:
                # The run stops (a refused key, an outage, a budget, Ctrl-C) during a follow-up
                # (a repair, a longer retry): the answer already paid for stands, as when a
                # follow-up fails; left pending, `resume` would pay for it again.
                if isinstance(exc, FatalError):
                    self._fatal(exc)
                sent = True
                if isinstance(exc, (BudgetReached, _Stopped)):  # held before it went: this
                    attempts, sent = attempts - 1, tries > 1  # try was not sent, an earlier was
                kept = plan.give_up(str(exc), sent=sent)
                if kept is not None and plan.last is not None:
                    return self._result(item, attempts, plan.last, kept, plan, lane)
                self._left(item, sent_here, tally)
                if isinstance(exc, _Stopped):
                    raise
                return None
            except anyio.get_cancelled_exc_class():
                # The stop's drain ran out (or a second Ctrl-C) with a follow-up on the wire:
                # the answer already paid for is handed back all the same (no await before
                # the worker passes it to the writer; the next one re-raises the cancel). A
                # cancel for any other reason (an error that ends the run) goes on as it came.
                kept = None
                if self.stopping.is_set() and plan.last is not None:
                    kept = plan.give_up("the run was stopped before the follow-up's answer came")
                if kept is None or plan.last is None:
                    self._left(item, sent_here, tally)
                    raise
                return self._result(item, attempts, plan.last, kept, plan, lane)
            except RequestError as exc:
                if isinstance(exc, BadRequest) and guided and not plan.unguided:
                    # maybe the schema, not the prompt: try once without it (another item
                    # may have found that out meanwhile; the schema goes unguided anyway)
                    plan.unguided, refusal = True, str(exc)
                    continue
                kept = plan.give_up(str(exc))  # a failed follow-up leaves the answer it had
                if kept is not None and plan.last is not None:
                    return self._result(item, attempts, plan.last, kept, plan, lane)
                return ItemResult(
                    line=item.line,
                    status="failed",
                    attempts=attempts,
                    error=str(exc),
                    extra_prompt_tokens=plan.estimated[0],
                    extra_completion_tokens=plan.estimated[1],
                    answered_by=self._named(lane),
                    answer_model=self._model(item, lane),
                )
            tally = Tally()  # a follow-up is a request of its own
            if refusal is not None:
                self._refused(plan, refusal)
                refusal = None
            outcome = plan.judge(completion)
            if outcome is not None:
                return self._result(item, attempts, completion, outcome, plan, lane)

    def _left(self, item: ClaimedItem, sent: int, tally: Tally) -> None:
        """The run ends without the item's result: what it spent, for the next run."""
        if sent or tally.charged != item.charged:
            self.spent.append(Spent(item.line, sent, tally.charged))

    def _refused(self, plan: AnswerPlan, error: str) -> None:
        """The server took the request without response_format after a 400 with it: that
        schema goes unguided from now on, said once per schema."""
        assert plan.schema is not None
        if self.rules.refuse(plan.schema, error):
            self.stats.guided_refused = self.stats.guided_refused or error
            self.log.event("guided_refused", error=error)

    def _named(self, lane: Lane) -> str | None:
        """The endpoint a result records: named with several (one left out at the start
        included), or given by name (`--endpoint a=URL`); a job's one URL needs none."""
        return None if self.fleet.only and not self.fleet.named else lane.name

    async def _ask_model(self, lane: Lane) -> None:
        """A lane whose server was away as the job started: its probe asks its model first,
        and the line goes under it (its answer filed under it). A server that will not say
        (401/403/404, or none listed) takes the lane out, as a request's 401 does."""
        try:
            route = await named_model(lane.route)
        except FatalError as exc:
            if self.fleet.take_out(lane, exc):
                raise Rerouted(f"{lane.name} left the job: {exc}") from None
            raise
        lane.learned(route, answer_spec(route.spec))
        self.log.event("endpoint_model", endpoint=lane.name, model=route.spec.model)

    def _model(self, item: ClaimedItem, lane: Lane) -> str | None:
        """The model its request asked for: the line's own, the job's, or its endpoint's."""
        model = item.body.get("model") or self.defaults.get("model") or lane.route.spec.model
        return model if isinstance(model, str) else None

    def _body(self, body: dict[str, Any], lane: Lane, item: ClaimedItem) -> dict[str, Any]:
        """The request's body for `lane`: its model, with several endpoints."""
        model = lane.route.spec.model
        if self.fleet.only is None and model and "model" not in item.body:
            return {**body, "model": model}
        return body

    def _not_the_jobs(self, item: ClaimedItem, lane: Lane) -> bool:
        """With one endpoint: the line asked for another API kind or model than the job's own,
        so a 404 to it says nothing of the job (its other lines show whether the endpoint
        serves). A job with no model of its own: a 404 may be the endpoint's, and stops it."""
        model = self.defaults.get("model")
        asked = item.body.get("model")
        return item.endpoint != lane.route.spec.endpoint or (model is not None and asked != model)

    def _result(
        self,
        item: ClaimedItem,
        attempts: int,
        c: Completion,
        outcome: Outcome,
        plan: AnswerPlan,
        lane: Lane,
    ) -> ItemResult:
        self.stats.output_tokens += plan.usage[1] or 0
        self.stats.repairs += plan.repairs
        self.stats.repair_tokens += plan.repair_prompt_tokens + plan.repair_completion_tokens
        return ItemResult(
            line=item.line,
            status=outcome.status,
            attempts=attempts,
            latency_ms=c.latency_s * 1000,
            ttft_ms=_ms(c.ttft_s),
            prompt_tokens=plan.usage[0],
            completion_tokens=plan.usage[1],
            finish_reason=c.finish_reason,
            output=c.text,
            parsed=outcome.parsed,
            error=outcome.error,
            repairs=plan.repairs,
            repair_prompt_tokens=plan.repair_prompt_tokens,
            repair_completion_tokens=plan.repair_completion_tokens,
            extra_prompt_tokens=plan.estimated[0],
            extra_completion_tokens=plan.estimated[1],
            answered_by=self._named(lane),
            answer_model=self._model(item, lane),
            answer_spec=lane.answer_spec,
        )


def _asked_itself(item: ClaimedItem, lane: Lane) -> bool:
    """Whether the line chose its model or API kind itself (not the endpoint's or the job's)."""
    return "model" in item.body or item.endpoint != lane.route.spec.endpoint


def _completion_of(previous: dict[str, Any]) -> Completion:
    """A stored batch answer as a Completion (no timings: it came in a file)."""
    return Completion(
        text=str(previous.get("text") or ""),
        finish_reason=previous.get("finish_reason"),
        prompt_tokens=previous.get("prompt_tokens"),
        completion_tokens=previous.get("completion_tokens"),
        latency_s=0.0,
        ttft_s=None,
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


@dataclass(eq=False)
class Lead:
    """A prefix group's first line while its request is under way: `done` is set at its first
    token (or its end), and `lane` is where it went."""

    done: anyio.Event = field(default_factory=anyio.Event)
    lane: Lane | None = None


class _Stopped(Exception):
    """A request that waited past the run's stop (for a slot, or to retry): not sent. Not a
    RequestError, so no attempt is counted and no retry follows."""
