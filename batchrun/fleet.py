"""The job's endpoints, each a lane with its own backend, throttle (adaptive limit, rpm/tpm) and
outage watch; a request goes out on whichever lane has a free slot, so faster endpoints take
more of the work.

A lane is `up` (sent to), `down` (its failures say it is unreachable: it is drained, and one
request now and then probes it, 1 s after it went down and then twice as long each time up to
30 s; the first answer brings it back up; or it refused REFUSALS_TO_DRAIN lines in a row that
others answered: drained and probed the same, and only an answer brings it back) or `out` (a
401/403/404: its configuration is wrong, so it is not sent to again in this run). While another
lane is up, a request that fails on an unreachable lane, or on one taken out, is sent again
elsewhere at once and costs its item no attempt (at most twice per endpoint, so a prompt that
breaks every server still runs out of attempts); the job stops only when every lane left has
been down past the outage grace period or drained for refusing (EndpointDown), or every lane is
out (its error). With outage handling off (a grace period of 0) a lane that looks unreachable is
drained all the same, and while none is up the drained ones are sent to as if up: failures count
against the items, which fail; the job never stops for it.

Prefix groups (items sharing a long prompt prefix) keep to the lane that took their first item
when it has a free slot, so the prefix is cached once; a free slot elsewhere is never left idle
for the sake of that.

With one endpoint the fleet stands aside: the sender takes the lane's throttle directly, and
the lane's outage watch decides outages as it always did.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import anyio

from batchrun.errors import EndpointDown, FatalError, RateLimited, RequestError, TransientError
from batchrun.lanes import PROBE_FIRST_S, PROBE_MOST_S, EndpointUse, Lane, every_lane_lost
from batchrun.retrying import Clock, broken, endpoint_failure

AFFINITY_GROUPS = 4096  # prefix groups whose lane is remembered
WAKE_SCAN = 16  # waiters looked at for one whose group belongs to the lane that has room
FREE_TRIES = 2  # per endpoint: how often one item may fail for free on failing endpoints
# Lines in a row that an endpoint refused and others then answered, before it is drained: lines
# it refuses are then its rule, not a few prompts' fault. A share f of lines it refuses gives
# such a run by chance with odds f**4; drained by mistake, it is back at its first answer.
REFUSALS_TO_DRAIN = 4

_PROBING = object()  # a probe's lane, picked and not yet given its item


class Rerouted(TransientError):
    """The lane this request went to is out of the job: send it again on another one (free)."""


@dataclass(eq=False)
class _Waiter:
    group: int | None
    key: Hashable = None  # its item
    event: anyio.Event = field(default_factory=anyio.Event)


class Fleet:
    """The lanes, and the outage rules over them (the RetryPolicy's `outage`)."""

    def __init__(
        self,
        lanes: list[Lane],
        *,
        clock: Clock,
        on_event: Callable[..., None] | None = None,
        left_out: Sequence[EndpointUse] = (),
        named: bool = False,
    ) -> None:
        self.lanes = lanes
        self.left_out = tuple(left_out)  # endpoints left out at start: named, never sent to
        self.named = named or bool(left_out)  # results name their endpoint: given by name
        self.only = lanes[0] if len(lanes) == 1 else None  # one endpoint: the fast path
        self.clock = clock
        self.grace = lanes[0].outage.grace
        self._on_event = on_event or (lambda _name, **_fields: None)
        self._sent_to: dict[Hashable, Lane] = {}  # item -> the lane of its latest request
        self._waiters: deque[_Waiter] = deque()
        self._woken = 0  # waiters woken that have not run yet
        self._affinity: OrderedDict[int, Lane] = OrderedDict()
        self._out_error: FatalError | None = None
        self._free: Counter[Hashable] = Counter()  # free tries per item, on failing endpoints
        self._refused: dict[Hashable, set[Lane]] = {}  # item -> lanes that refused it (4xx)
        self._missed: dict[Hashable, Lane] = {}  # item -> the lane it last failed to reach
        if self.only is None:
            for lane in lanes:
                lane.throttle.on_room = functools.partial(self._room, lane)

    # --- capacity ------------------------------------------------------------------------

    @property
    def limit(self) -> int:
        """The concurrency limits of the lanes still in the job, summed."""
        return sum(lane.throttle.limit for lane in self.lanes if lane.state != "out") or 1

    @property
    def in_flight(self) -> int:
        return sum(lane.throttle.in_flight for lane in self.lanes)

    async def pick(self, key: Hashable, group: int | None = None) -> Lane:
        """A lane with a free slot, that slot taken for the request's `throttle.slot(...,
        taken=True)`: the group's lane when it has room, else the least loaded for its
        weight; waits while none has. Raises EndpointDown, or the error that took the last
        lane out, when no lane is left to send to.

        Waiters go first: a request that comes while others wait (or were woken and have not
        run yet) waits behind them. Else the worker that freed a slot, going on to its next
        item without a trip through the event loop, would take the slot back before the
        waiter it woke could run: a retry waiting for a slot waited for the job to run dry."""
        came = True
        while True:
            self.check()
            queued = came and self._queued()
            lane = None if queued else self._take(group, self._refusers(key), key)
            if lane is not None:
                lane.sent += 1
                self._sent_to[key] = lane
                if lane.probe is _PROBING:
                    lane.probe = key
                if group is not None:
                    self._remember(group, lane)
                return lane
            waiter = _Waiter(group, key)
            if came:
                self._waiters.append(waiter)
            else:  # woken and beaten to the slot: still first in turn
                self._waiters.appendleft(waiter)
            came = False
            try:
                with anyio.move_on_after(self._until_due()):
                    await waiter.event.wait()
            finally:
                if waiter.event.is_set():
                    self._woken -= 1
                else:
                    self._waiters.remove(waiter)

    def _queued(self) -> bool:
        """Whether a request that comes now waits behind the waiters: while one was woken, or
        may take a slot free now. A slot that every waiter was refused on (no wake-up comes
        for it: _room) goes to whoever comes, or its lane would stand idle behind them; unless
        that lane refused as many lines since its last answer as would drain it: it may refuse
        everything, and the newcomer too."""
        if self._woken or not self._waiters:
            return bool(self._woken)
        up = self.lanes if self._refused else ()
        free = [
            lane
            for lane in up
            if lane.state == "up" and lane.throttle.free and lane.refused_lately < REFUSALS_TO_DRAIN
        ]
        refusers = self._refusers
        return not free or any(lane not in refusers(w.key) for w in self._waiters for lane in free)

    def _refusers(self, key: Hashable) -> Collection[Lane]:
        """The lanes an item is kept from: those that refused it, unless no other lane may
        answer it any more (then it goes to one that refused it, and fails there unless it
        answers: refused)."""
        refused = self._refused.get(key, ())
        others = (lane for lane in self.lanes if lane not in refused)
        return refused if not refused or any(map(self._may_answer, others)) else ()

    def _may_answer(self, lane: Lane) -> bool:
        """Whether a line not refused by `lane` may be sent to it, now or later: it is up,
        drained for refusing other lines (reachable), or down for an outage that may yet end
        (outages handled, not past the grace)."""
        if lane.state == "up" or (lane.state == "down" and lane.refusing):
            return True
        return lane.state == "down" and self.grace > 0 and not lane.lost(self.clock(), self.grace)

    def _take(self, group: int | None, refused: Collection[Lane], key: Hashable) -> Lane | None:
        now = self.clock()
        lanes = [lane for lane in self.lanes if lane not in refused]
        for lane in lanes:  # first a probe of a lane that is down, when one is due
            due = lane.state == "down" and lane.probe is None and now >= lane.probe_at
            if due and lane.throttle.take():
                lane.probe = _PROBING  # the pick names the item
                self._on_event("endpoint_probe", endpoint=lane.name)
                return lane
        up = [lane for lane in lanes if lane.state == "up"]
        if not up:  # drained lanes, sent to as if up when there is nothing to wait for:
            down = [lane for lane in lanes if lane.state == "down"]
            waited = [lane for lane in down if not lane.refusing and self._may_answer(lane)]
            if self.grace <= 0:  # outages not handled
                up = down
            elif not waited:  # the lanes left for it only refuse (other) lines: reachable
                up = [lane for lane in down if lane.refusing]
        if any(lane.route.weight > 0 for lane in up):  # weight 0: a fallback
            up = [lane for lane in up if lane.route.weight > 0]
        up = [lane for lane in up if lane.rests_until <= now] or up  # after a 429: others first
        # an endpoint whose own --rpm would hold the request waits while another may send now
        up = [lane for lane in up if lane.throttle.pacer.ready(now)] or up
        # the lane the item last failed to reach goes last: it stays "up" for one line's
        # failures, and as its group's lane, or the least loaded, would take every retry back
        missed = self._missed.get(key)
        preferred = self._affinity.get(group) if group is not None else None
        if preferred not in (None, missed) and preferred in up and preferred.throttle.take():
            return preferred
        for lane in sorted(up, key=lambda lane: (lane is missed, lane.load())):
            if lane.throttle.take():
                return lane
        return None

    def _until_due(self) -> float | None:
        """How long a waiter may sleep: until the next probe is due, and at most a second
        while a lane is down (the outage grace is looked at again: a line waiting for that
        lane may have to go elsewhere, and no slot coming free may wake it); None while no
        lane is down."""
        down = [lane for lane in self.lanes if lane.state == "down"]
        now = self.clock()
        due = [lane.probe_at - now for lane in down if lane.probe is None]
        due += [lane.rests_until - now for lane in self.lanes if lane.rests_until > now]
        return max(0.01, min([*due, PROBE_FIRST_S] if down else due)) if due or down else None

    def _room(self, lane: Lane) -> None:
        """A slot came free on `lane` (or its limit rose): wake one waiter that may take it,
        the first whose prefix group belongs to that lane if one is near the front. (A line
        that `lane` refused would take the wake-up and wait on, and `lane` would stand idle.)"""
        waiters, refusers = self._waiters, self._refusers
        able = (w for w in waiters if lane not in refusers(w.key)) if self._refused else waiters
        first = None
        for waiter in islice(able, WAKE_SCAN):
            first = first or waiter
            if waiter.group is not None and self._affinity.get(waiter.group) is lane:
                break
        else:
            if first is None:
                return
            waiter = first
        self._waiters.remove(waiter)
        self._wake(waiter)

    def _wake_all(self) -> None:
        while self._waiters:
            self._wake(self._waiters.popleft())

    def _wake(self, waiter: _Waiter) -> None:
        self._woken += 1  # until it runs: its turn is kept (see pick)
        waiter.event.set()

    def _remember(self, group: int, lane: Lane) -> None:
        if self._affinity.get(group) is None or self._affinity[group].state != "up":
            self._affinity[group] = lane
        self._affinity.move_to_end(group)
        if len(self._affinity) > AFFINITY_GROUPS:
            self._affinity.popitem(last=False)

    # --- outages (the RetryPolicy's view) --------------------------------------------------

    def lane_of(self, key: Hashable) -> Lane:
        return self.only or self._sent_to[key]

    def ended(self, lane: Lane, key: Hashable, error: BaseException | None) -> None:
        """A request on `lane` ended (before the retry policy hears of it). Any answer from
        the server, an error status too, says it is reachable: a lane that was down is up
        again. A probe that failed to reach it comes due again later, twice as late."""
        answered = isinstance(error, RequestError) and not endpoint_failure(error)
        if answered:  # an error status: an outage, if one follows, starts after it
            lane.outage.reached()
        if self.only is not None:
            return
        reached = error is None or (answered and not lane.refusing)
        if reached and lane.state == "down":
            lane.state, lane.reason, lane.probe, lane.refusing = "up", "", None, False
            self._on_event("endpoint_up", endpoint=lane.name)
            self._wake_all()
        elif lane.probe == key and lane.probe is not None:
            lane.probe = None
            if not isinstance(error, RequestError):  # stopped, not answered: due again now
                return
            lane.probe_wait = min(PROBE_MOST_S, lane.probe_wait * 2)
            lane.probe_at = self.clock() + lane.probe_wait

    def success(self, key: Hashable = None, sent: float | None = None) -> None:
        lane = self.only or self._sent_to.pop(key)
        self._free.pop(key, None)
        self._missed.pop(key, None)
        lane.outage.success(key, sent)
        lane.answered += 1
        lane.refusals = lane.refused_lately = 0
        refusers = self._refused.pop(key, None)  # none with one endpoint: nothing to do
        for refuser in refusers - {lane} if refusers else ():  # another answered what it refused
            refuser.refusals += 1
            if refuser.refusals >= REFUSALS_TO_DRAIN and refuser.state == "up":
                self._down(refuser, refusing=True)

    def failure(self, exc: TransientError, key: Hashable = None) -> bool:
        """Note a failed request; True: it costs its item no attempt."""
        if isinstance(exc, Rerouted):
            return True
        lane = self.lane_of(key)
        free = lane.outage.failure(exc, key)
        lane.errors += 1
        if self.only is not None:
            return free
        if lane.state == "up" and lane.outage.unreachable:
            self._down(lane)
        elif lane.refusing and lane.outage.unreachable:  # drained for refusing, and now gone
            lane.refusing, lane.reason = False, lane.outage.last_error
        if free:
            return True
        limited = isinstance(exc, RateLimited)  # the endpoint's limit, not the line's fault
        if limited:
            lane.rests_until = max(lane.rests_until, self.clock() + (exc.retry_after or 1.0))
        elif not endpoint_failure(exc) or lane.outage.suspect(key):
            return False
        if broken(exc) and lane.state == "up":  # a broken answer (cut, not JSON), counted as
            lane.refusal = str(exc)  # a refusal: one that breaks line after line that others
            self._refused.setdefault(key, set()).add(lane)  # answer is drained (success)
        if self._free[key] >= FREE_TRIES * len(self.lanes):
            return False  # it fails wherever it goes: its own fault, its attempts count
        if any(self._takes(other, key, limited) for other in self.lanes if other is not lane):
            self._free[key] += 1
            if not limited:  # a 429 is no miss: that lane rests, the others first anyway
                self._missed[key] = lane
            return True
        return False

    def _takes(self, lane: Lane, key: Hashable, awake: bool = True) -> bool:
        """Whether `lane` takes the item another failed: it is up, has not refused it, and (if
        `awake`: now, not after a 429's wait) is not resting after a 429 of its own, nor a
        fallback while a weighted lane is up, resting or not (_take sends it nothing then)."""
        if lane.state != "up" or lane in self._refused.get(key, ()):
            return False
        if not awake:
            return True
        weighted = any(other.route.weight and other.state == "up" for other in self.lanes)
        return lane.rests_until <= self.clock() and not (weighted and not lane.route.weight)

    def resend_now(self, key: Hashable) -> bool:
        """Whether the item's next try should go at once: its lane refused it, or is down or
        out, and another is up to take it."""
        if self.only is not None:
            return False
        lane = self._sent_to.get(key)
        if lane in self._refused.get(key, ()):  # its latest lane refused it
            return True
        if lane is not None and lane is self._missed.get(key):  # it failed to reach it
            return any(self._takes(other, key) for other in self.lanes if other is not lane)
        if lane is None or self._takes(lane, key):
            return False
        return any(self._takes(other, key) for other in self.lanes if other is not lane)

    @property
    def down(self) -> bool:
        return any(lane.outage.down for lane in self.lanes)

    def check(self) -> None:
        if self.only is not None:
            self.only.outage.check()
            return
        live = [lane for lane in self.lanes if lane.state != "out"]
        if not live:
            assert self._out_error is not None
            raise self._out_error
        if self.grace > 0 and (why := every_lane_lost(live, self.clock(), self.grace)):
            raise EndpointDown(f"every endpoint unreachable for over {self.grace:g}s; {why}")

    def forget(self, key: Hashable) -> None:
        """The item is over (a result, or given up): nothing about it is kept."""
        self._sent_to.pop(key, None)
        self._free.pop(key, None)
        self._refused.pop(key, None)
        self._missed.pop(key, None)

    def refused(self, lane: Lane, key: Hashable, error: RequestError) -> bool:
        """`lane` refused the item's request (a 400; a 404 to a model or API the line asked for
        itself): the item's fault or that lane's, not the job's. True while a lane that has not
        refused it may answer it (_may_answer): the request goes there, free, or waits for it
        (else an endpoint that refuses at once, always the least busy, would fail the items a
        healthy one could answer). False: none may, and it fails; a lane down for an outage is
        waited for only until the grace is past, so no item waits for ever. A lane that refuses
        line after line that others answer is drained (success)."""
        lane.errors += 1
        lane.refusal = str(error)
        lane.refused_lately += 1
        tried = self._refused.setdefault(key, set())
        tried.add(lane)
        if any(self._may_answer(other) for other in self.lanes if other not in tried):
            return True
        del self._refused[key]
        return False

    def take_out(self, lane: Lane, error: FatalError) -> bool:
        """A 401/403/404 from `lane`: it leaves the job. True while other lanes remain (the
        request goes to one of them); False: it was the last, and the job stops."""
        if self.only is not None:
            return False
        lane.errors += 1
        if lane.state != "out":
            lane.state, lane.reason = "out", str(error)
            self._out_error = error
            self._on_event("endpoint_out", endpoint=lane.name, error=str(error))
        if all(other.state == "out" for other in self.lanes):
            return False
        self._wake_all()
        return True

    def _down(self, lane: Lane, *, refusing: bool = False) -> None:
        lane.state, lane.refusing = "down", refusing
        refused = f"refused {lane.refusals} lines in a row that others answered: {lane.refusal}"
        lane.reason = refused if refusing else lane.outage.last_error
        lane.probe_wait = PROBE_FIRST_S
        lane.probe_at = self.clock() + lane.probe_wait
        self._on_event("endpoint_down", endpoint=lane.name, error=lane.reason)
        self._wake_all()  # waiters for its slots look at the others (a fallback, say)

    def uses(self) -> list[EndpointUse]:
        return [*(lane.use() for lane in self.lanes), *self.left_out]

    def describe(self) -> dict[str, Any]:
        """Per endpoint, for the worker's row (what `status` shows)."""
        return {u.name: dataclasses.asdict(u) for u in self.uses()}
