"""A server's own count of running and waiting requests, read from its Prometheus /metrics page
(or, for llama-server started without --metrics, from its /slots page).

Inference engines know what the client can only guess: how many requests they are decoding in
their batch and how many wait for a slot. Where an endpoint publishes those counts, the
concurrency controller can keep the batch full and the queue near zero instead of inferring both
from latency. This module is pure text handling (the exposition format and the URL); the HTTP
read is batchrun.backends.metrics_reader, since only backends/ talk HTTP.

The names, checked against the engines' sources:
- vLLM (vllm/v1/metrics/loggers.py): `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (a fraction, despite the name; `vllm:gpu_cache_usage_perc` before).
- SGLang (python/sglang/srt/metrics/collector.py, with --enable-metrics): `sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:token_usage`.
- llama.cpp's llama-server (tools/server/server-task.cpp, with --metrics):
  `llamacpp:requests_processing`, `llamacpp:requests_deferred`; older builds also had
  `llamacpp:kv_cache_usage_ratio`. Without --metrics it still serves GET /slots (on by default,
  `--no-slots` turns it off): a JSON array, one object per slot, busy when `is_processing` is
  true (older builds: `state` other than 0). That says how many slots it has and how many run,
  not how many wait.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import orjson


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """What the server says about itself: requests in its batch, requests queued for a slot, and
    how full its KV cache is (0..1) where it says so; `source` names the engine recognised.
    `slots`: how many requests it runs at once, where it says so instead of counting those
    that wait (llama-server's /slots: `waiting` is None)."""

    running: float
    waiting: float | None
    kv_usage: float | None = None
    source: str = ""
    slots: int | None = None

    @property
    def slots_page(self) -> bool:
        return self.waiting is None and self.slots is not None

    def waiting_with(self, in_flight: int) -> float:
        """Requests waiting, with `in_flight` of ours sent. Where the server says how many slots
        it has but not how many wait (llama-server's /slots): none while a slot is free (it
        starts a request as soon as one is), and once every slot is busy, ours in flight
        beyond them (other clients' are unseen)."""
        if self.waiting is not None:
            return self.waiting
        if self.slots is None or self.running < self.slots:
            return 0.0
        return max(0.0, in_flight - self.running)


class PagePart:
    """Whether a load page speaks for the whole server, judged by `streaming`, ours whose
    answers are coming in now: more of them than the page can count (a slots page's slots, a
    metrics page's running and waiting requests), past a margin for answers the client has
    yet to read to the end, twice in a row, means the page is one of several servers behind a
    balancer (llama-servers, vLLM replicas). From then on it is `partial` for good."""

    def __init__(self) -> None:
        self.partial = False
        self._over = 0  # consecutive reads with more of ours streaming than it counts

    def read(self, load: ServerLoad, streaming: int) -> bool:
        """Whether the page is partial, this read included."""
        counted = load.slots if load.slots_page else load.running + (load.waiting or 0)
        over = counted is not None and streaming > counted + max(2, int(counted) // 4)
        self._over = self._over + 1 if over else 0
        self.partial = self.partial or self._over >= 2
        return self.partial

    def quiet(self) -> None:
        self._over = 0


@dataclass(frozen=True, slots=True)
class _Engine:
    source: str
    running: str
    waiting: str
    kv: tuple[str, ...]  # the current name first, then older ones


ENGINES = (
    _Engine(
        "vllm",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    _Engine("sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",)),
    _Engine(
        "llamacpp",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        ("llamacpp:kv_cache_usage_ratio",),
    ),
)
_WANTED = frozenset(name for e in ENGINES for name in (e.running, e.waiting, *e.kv))
_NAME_END = re.compile(r"[{\s]")  # a sample's name runs up to its labels or its value


def parse_load(text: str) -> ServerLoad | None:
    """The load on a page that is either a Prometheus page or llama-server's /slots array."""
    return parse_slots(text) if text.lstrip().startswith("[") else parse_metrics(text)


def parse_slots(text: str) -> ServerLoad | None:
    """llama-server's /slots page as a load (`waiting` None), or None when it is not one."""
    try:
        slots = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(slots, list) or not slots or not all(isinstance(s, dict) for s in slots):
        return None
    busy = [_busy(slot) for slot in slots]
    if None in busy:
        return None
    return ServerLoad(float(sum(map(bool, busy))), None, None, "llamacpp-slots", len(slots))


def _busy(slot: dict[str, object]) -> bool | None:
    processing = slot.get("is_processing")
    if isinstance(processing, bool):
        return processing
    state = slot.get("state")  # builds before is_processing: 0 idle, 1 processing
    return state != 0 if isinstance(state, int) and not isinstance(state, bool) else None


def parse_metrics(text: str) -> ServerLoad | None:
    """The load in a Prometheus text page, or None when no known engine's pair of counts is there.

    Series of one name with different labels (one per model, per data-parallel engine) are
    summed: together they are the server's batch and queue. The KV usage is a fraction per
    engine, so the fullest engine's figure, not a sum. NaN and infinite samples are ignored."""
    samples = _samples(text)
    for engine in ENGINES:
        running, waiting = samples.get(engine.running), samples.get(engine.waiting)
        if running and waiting:
            kv = next((max(samples[name]) for name in engine.kv if samples.get(name)), None)
            return ServerLoad(sum(running), sum(waiting), kv, engine.source)
    return None


def metrics_url(base_url: str, page: str = "metrics") -> str:
    """Where the endpoint at `base_url` publishes its metrics (`page="slots"`: llama-server's
    slots).

    Engines serve the OpenAI API under /v1 and /metrics at their root, so a trailing /v1 is
    dropped (`http://host:8000/v1` -> `http://host:8000/metrics`). Any path before it is kept:
    behind a proxy that mounts the server under a prefix, the prefix leads to its root too
    (`https://gw/llm/v1` -> `https://gw/llm/metrics`). Query and fragment are dropped."""
    parts = urlsplit(base_url.strip())
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, f"{path}/{page}", "", ""))


def _samples(text: str) -> dict[str, list[float]]:
    """The values of the series this module reads, by metric name, in page order."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        sample = _sample(line)
        if sample is not None:
            found.setdefault(sample[0], []).append(sample[1])
    return found


def _sample(line: str) -> tuple[str, float] | None:
    """`name{labels} value [timestamp]` as (name, value), for the names wanted; else None.

    The name is checked before the labels are read, so the many histogram lines of a vLLM page
    cost a split and a set lookup each."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    name = _NAME_END.split(line, maxsplit=1)[0]
    if name not in _WANTED:
        return None
    rest = line[len(name) :].lstrip()
    if rest.startswith("{"):
        close = _labels_end(rest)
        if close < 0:
            return None
        rest = rest[close + 1 :]
    fields = rest.split()
    try:
        value = float(fields[0]) if fields else math.nan
    except ValueError:
        return None
    return (name, value) if math.isfinite(value) else None


def _labels_end(text: str) -> int:
    """Where the `}` closing the label set that opens `text` is; -1 if it never closes.

    Label values are quoted and may hold `}`, `,` and escaped quotes (`\\"`), so braces count
    only outside quotes."""
    quoted = escaped = False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return i
    return -1
