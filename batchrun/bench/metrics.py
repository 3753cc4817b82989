"""Per-request records and what they add up to, with the names vLLM's and SGLang's benchmarks use.

- TTFT: time to first token, from sending to the first non-empty content delta.
- TPOT: time per output token after the first, (E2E - TTFT) / (output tokens - 1), per request.
- ITL: inter-token latency, the gaps between consecutive content deltas, over all requests.
- E2E: end-to-end latency, from sending to the last byte.
Each as P50/P95/P99 and mean (milliseconds); request throughput and output token throughput
(successful requests, tokens per second of the cell's wall time); success rate and error codes;
for a class with a schema, the share of answers that validate; server-side timings when the
server reports them.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

# Fewest samples for a percentile to be more than the maximum (or the median) in disguise.
MIN_SAMPLES = {"p50": 2, "p95": 20, "p99": 100}
KNEE_GAIN = 1.10  # a step must buy at least 10% more throughput to be worth its latency


@dataclass
class RequestRecord:
    endpoint: str
    cls: str
    concurrency: int
    ok: bool
    started_s: float  # since the cell started
    e2e_ms: float
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    tokens_from: str = "usage"  # or "chunks" when the server sent no usage
    error_code: str | None = None  # HTTP status, or the error kind for transport failures
    error: str | None = None
    schema_valid: bool | None = None
    server_timing: dict[str, float] | None = None
    chunks: int = 0  # streamed content deltas: what the client had to parse

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1) of unsorted values; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def distribution(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 0.50),
        "p95": percentile(values, 0.95),
        "p99": percentile(values, 0.99),
        "mean": sum(values) / len(values) if values else None,
        "n": len(values),
    }


def summarize(records: list[RequestRecord], wall_s: float, repeated: int = 0) -> dict[str, Any]:
    """One cell (endpoint x class x concurrency): distributions, throughput, errors.
    `repeated`: its requests whose prompt the sweep sent before (warned of: cached)."""
    ok = [r for r in records if r.ok]
    # refused for itself (a 4xx but 408/429: too long for the context, say): at any load
    own = sum(not r.ok and _own_fault(r.error_code) for r in records)
    tokens = sum(r.output_tokens or 0 for r in ok)
    # An answer whose token count is unknown (no usage, not streamed): tokens/s unknown too
    counted = all(r.output_tokens is not None for r in ok)
    checked = [r.schema_valid for r in ok if r.schema_valid is not None]
    timing_keys = sorted({k for r in ok for k in (r.server_timing or {})})
    server = {
        key: distribution(
            [r.server_timing[key] * 1000 for r in ok if r.server_timing and key in r.server_timing]
        )
        for key in timing_keys
    }
    cell: dict[str, Any] = {
        "requests": len(records),
        "succeeded": len(ok),
        "success_rate": len(ok) / len(records) if records else None,
        "load_success_rate": len(ok) / (len(records) - own) if len(records) > own else None,
        "repeated_prompts": repeated,
        "errors": dict(Counter(r.error_code or "error" for r in records if not r.ok)),
        "wall_s": wall_s,
        "request_throughput": len(ok) / wall_s if wall_s > 0 else None,
        "output_throughput": tokens / wall_s if wall_s > 0 and counted else None,
        "tokens_unknown": not counted,
        "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": distribution([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itl_ms]),
        "e2e_ms": distribution([r.e2e_ms for r in ok]),
        "schema_valid_rate": sum(checked) / len(checked) if checked else None,
        "server_timing_ms": server or None,
        "tokens_from_chunks": any(r.tokens_from == "chunks" for r in ok),
        "chunk_rate": sum(r.chunks for r in ok) / wall_s if wall_s > 0 else None,
    }
    cell["warnings"] = sample_warnings(cell)
    return cell


def sample_warnings(cell: dict[str, Any]) -> list[str]:
    """Say when a percentile has too few samples to be more than the maximum: with nearest
    rank, P95 of fewer than 20 samples and P99 of fewer than 100 are the largest one."""
    n = cell["e2e_ms"]["n"]
    said = [
        f"{name.upper()} from {n} samples is the maximum (needs {least} or more)"
        for name, least in MIN_SAMPLES.items()
        if 0 < n < least and name != "p50"
    ]
    if repeated := cell.get("repeated_prompts"):
        said.append(
            f"{repeated} of {cell['requests']} requests repeat a prompt sent before in this "
            "sweep (the suite ran out): a prompt cache may have spared their prefill (lower "
            "TTFT); give more prompts"
        )
    return said


def _own_fault(code: str | None) -> bool:
    """An HTTP 4xx that says the request itself is refused (not 408 or 429: load's)."""
    return code is not None and code.isdigit() and code.startswith("4") and code not in LOADS


LOADS = ("408", "429")  # the 4xx a server gives for its load, not for the request


def knee(levels: list[tuple[int, float, float | None, float]]) -> dict[str, Any]:
    """The recommended concurrency from (concurrency, throughput, P95 E2E ms, success rate)
    per level: the last level before throughput grows by less than 10% while P95 latency keeps
    rising, or before requests start failing (for the load: the success rate of requests not
    refused for themselves, load_success_rate; a level that sent other prompts may meet more
    of those)."""
    ordered = sorted(levels)
    if not ordered:
        return {"concurrency": None, "reason": "no levels measured"}
    if ordered[0][3] == 0:
        return {"concurrency": None, "reason": f"every request failed at {ordered[0][0]}"}
    for (c, tps, p95, ok), (c_next, tps_next, p95_next, ok_next) in itertools.pairwise(ordered):
        if ok_next < ok or p95_next is None:
            return {
                "concurrency": c,
                "reason": f"{c} -> {c_next}: success rate {ok:.0%} -> {ok_next:.0%}",
            }
        assert p95 is not None
        if tps_next < tps * KNEE_GAIN and p95_next > p95:
            gain = f"{tps_next / tps - 1:+.0%}" if tps > 0 else "none"
            return {
                "concurrency": c,
                "reason": f"{c} -> {c_next}: throughput {gain} (under {KNEE_GAIN - 1:.0%}), "
                f"P95 latency {p95_next / p95 - 1:+.0%}",
            }
    top = ordered[-1]
    if len(ordered) > 1 and top[1] < ordered[-2][1] * KNEE_GAIN:  # and P95 did not rise
        reason = "throughput flat at the highest levels, P95 latency too: no knee seen"
    else:
        reason = "throughput still growing at the highest level measured: try higher levels"
    return {"concurrency": top[0], "reason": reason}
