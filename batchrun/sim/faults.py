"""Seeded fault injection for the simulator: what a long nightly run meets, on demand.

Which request gets which fault depends only on the seed, the prompt and how many times that
prompt has been asked before, never on timing or request order, so a failing test replays the
same way at any concurrency (as long as prompts are distinct: identical prompts share a count).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence

import orjson

# Answered with an HTTP status, with the connection intact:
STATUS_FAULTS = {"429": 429, "500": 500, "502": 502, "503": 503, "504": 504}
# Played by the transport or server: no answer, a dropped connection, or a broken body.
TRANSPORT_FAULTS = ("reset", "hang", "cut")
BODY_FAULTS = ("nonjson", "empty")
FAULT_KINDS = (*STATUS_FAULTS, *TRANSPORT_FAULTS, *BODY_FAULTS)


def check_rates(
    rates: Mapping[str, float], known: Sequence[str] = FAULT_KINDS, what: str = "fault"
) -> dict[str, float]:
    """Validate a {kind: probability} table; returns it as a plain dict."""
    unknown = sorted(set(rates) - set(known))
    if unknown:
        raise ValueError(f"unknown {what} kind(s) {unknown}; known: {', '.join(known)}")
    for kind, rate in rates.items():
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"{what} rate for {kind} must be between 0 and 1, got {rate!r}")
    total = math.fsum(rates.values())
    if total > 1 + 1e-9:  # tolerance: 0.34 + 0.56 + 0.1 is 1.0000000000000002 in floats
        raise ValueError(f"{what} rates add up to {total:.6g}, more than 1")
    return {kind: float(rate) for kind, rate in rates.items()}


class FaultPlan:
    """Decides, per request, whether to inject a fault and which; counts what it injected."""

    def __init__(self, rates: Mapping[str, float], seed: int = 0) -> None:
        self.rates = check_rates(rates)
        self.seed = seed
        self.injected: Counter[str] = Counter()
        self._asked: Counter[str] = Counter()  # requests seen per prompt tag

    def pick(self, tag: str) -> str | None:
        if not self.rates:
            return None  # and remember nothing: a long fault-free run costs no memory here
        n = self._asked[tag]
        self._asked[tag] += 1
        digest = hashlib.sha256(f"{self.seed}:{tag}:{n}".encode()).digest()
        u = int.from_bytes(digest[:8], "big") / 2**64
        edge = 0.0
        for kind in FAULT_KINDS:
            edge += self.rates.get(kind, 0.0)
            if u < edge:
                self.injected[kind] += 1
                return kind
        return None

    def unpick(self, tag: str, kind: str) -> None:
        """The fault drawn was never played (the request was refused first): not counted,
        and its draw is the next request's, as if this one had not come."""
        self._asked[tag] -= 1
        self.injected -= Counter({kind: 1})  # (a count of 0 is dropped)


def status_fault(kind: str, retry_after_ms: float) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of an HTTP-status fault."""
    status = STATUS_FAULTS[kind]
    headers = {"content-type": "application/json"}
    if status == 429:
        headers["retry-after-ms"] = f"{retry_after_ms:g}"
        headers["retry-after"] = str(max(1, math.ceil(retry_after_ms / 1000)))
    message = {429: "rate limited (simulated)"}.get(status, f"simulated HTTP {status}")
    body = orjson.dumps({"error": {"message": message, "type": "sim_fault", "code": status}})
    return status, headers, body


def body_fault(kind: str, stream: bool) -> tuple[dict[str, str], bytes]:
    """A 200 whose body is useless: not JSON at all, or JSON/SSE with no choices."""
    if kind == "nonjson":
        return {"content-type": "application/json"}, b"<html><body>502 Bad Gateway</body></html>"
    if stream:
        return {"content-type": "text/event-stream"}, b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    return {"content-type": "application/json"}, b'{"object": "chat.completion", "choices": []}'
