"""Job spec: presets, TOML spec files and command-line options merged into one frozen object.

Precedence, lowest first: built-in defaults < backend preset < the spec stored with the job (on
resume) < a `--spec` TOML file < the command line. The resolved spec is stored with the job so a
resume runs the same way; it holds the *name* of the API-key variable, never the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from batchrun.endpoints import not_a_name, parse_endpoints, url_problem
from batchrun.errors import OptionError, UsageError
from batchrun.presets import PRESETS, Preset

ENDPOINTS = ("chat", "completions")
ON_TRUNCATE = ("fail", "retry-longer")
ORDERS = ("auto", "prefix", "input")


# The spec's parts, for the layers that need only one: the input reader takes the guards, the
# throttle the pacing, the retry policy the retries (the backend is built from the endpoint
# fields in backends/build.py, the output rules from the output fields in jobs.py).


@dataclass(frozen=True)
class InputGuards:
    """What a line may be before it is refused, checked when the file is loaded."""

    max_line_bytes: int = 1_000_000
    max_input_chars: int | None = None
    max_input_tokens: int | None = None  # estimated at 4 characters a token


@dataclass(frozen=True)
class Pacing:
    """How many requests go at once, and how fast."""

    concurrency: int | str = "auto"  # "auto": the adaptive controller (controller.py), or a number
    max_concurrency: int = 256  # the most "auto" may reach
    rpm: float | None = None  # client-side pacing: requests per minute
    tpm: float | None = None  # ... and tokens per minute (estimated, corrected by usage)

    @property
    def adaptive(self) -> bool:
        return self.concurrency == "auto"

    @property
    def most_in_flight(self) -> int:
        """Requests that may ever be in flight at once: workers, connections, claims."""
        return self.max_concurrency if isinstance(self.concurrency, str) else self.concurrency


@dataclass(frozen=True)
class Retries:
    max_attempts: int = 5  # requests per item, at most
    outage_timeout: float = 60.0  # seconds the endpoint may stay down before the job stops


# Options that change what an answer is (not how fast it comes): workers of one job must agree
# on them.
ANSWER_FIELDS = (
    "model",
    "endpoint",
    "max_tokens",
    "temperature",
    "top_p",
    "schema",
    "on_truncate",
    "max_tokens_cap",
    "guided",
    "repair_attempts",
)


@dataclass(frozen=True)
class RunSpec:
    """Every run option, flat, under the names the CLI, spec files and the API share: what is
    merged, checked and stored with the job. Its parts (above) are what layers take."""

    backend: str = "custom"
    base_url: str = ""
    model: str | None = None
    api_key_env: str | None = None
    endpoint: str = "chat"
    # Several endpoints (endpoints.py syntax); when given, they replace backend/base_url/key.
    endpoints: tuple[str, ...] = ()
    # Claim order: lines sharing a long prompt prefix together ("prefix"), or "input"; "auto":
    # prefix, but input against llama.cpp's server (its slots' caches are not shared).
    order: str = "auto"
    # The Batch API (hosted.py): "batch" sends pending items as hosted batches; then "online"
    # sends what they leave (failed, expired) as ordinary requests.
    mode: str = "online"
    then: str = "none"
    batch_max_requests: int = 50_000  # per batch file (OpenAI's limit)
    batch_max_bytes: int = 200_000_000  # ... and its size (OpenAI: 200 MB)
    poll_interval: float = 30.0  # seconds between looks at a running batch, at the longest
    stream: bool = True
    concurrency: int | str = "auto"  # "auto": the adaptive controller (controller.py), or a number
    max_concurrency: int = 256  # the most "auto" may reach
    server_metrics: str = "auto"  # the server's load page for "auto": auto | off | a URL
    rpm: float | None = None  # client-side pacing: requests per minute
    tpm: float | None = None  # ... and tokens per minute (estimated, corrected by usage)
    max_attempts: int = 5
    timeout: float = 120.0
    outage_timeout: float = 60.0
    lease: float = 60.0  # a worker silent longer than this loses its items to the others
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    schema: str | None = None
    guided: bool = True  # send the schema as response_format where the preset knows how
    repair_attempts: int = 1  # follow-up requests that show an invalid answer its error
    on_truncate: str = "fail"  # or "retry-longer": double max_tokens up to max_tokens_cap
    max_tokens_cap: int = 4096
    skip_invalid: bool = False
    redact: bool = False
    max_line_bytes: int = 1_000_000
    max_input_chars: int | None = None
    max_input_tokens: int | None = None
    reuse: bool = True  # copy earlier jobs' answers to the same requests instead of sending
    reuse_max_age: str | None = None  # only answers this recent ("7d"); None: any age
    max_total_tokens: int | None = None  # the job's budget: prompt + completion tokens
    max_cost: float | None = None  # ... or money, at these prices per million tokens:
    price_in: float | None = None
    price_out: float | None = None
    sim_options: dict[str, Any] = field(default_factory=dict)

    @property
    def guards(self) -> InputGuards:
        return InputGuards(self.max_line_bytes, self.max_input_chars, self.max_input_tokens)

    @property
    def pacing(self) -> Pacing:
        return Pacing(self.concurrency, self.max_concurrency, self.rpm, self.tpm)

    @property
    def retries(self) -> Retries:
        return Retries(self.max_attempts, self.outage_timeout)

    @property
    def adaptive(self) -> bool:
        return self.pacing.adaptive

    @property
    def most_in_flight(self) -> int:
        return self.pacing.most_in_flight

    def request_defaults(self) -> dict[str, Any]:
        """Body fields every request gets unless its input line overrides them."""
        fields = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        return {k: v for k, v in fields.items() if v is not None}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def api_key(self) -> str | None:
        """The key's value, read from the environment at the moment it is needed."""
        if not self.api_key_env:
            return None
        return os.environ.get(self.api_key_env) or None


class RunOptions(TypedDict, total=False):
    """Every run option, under the CLI's names; left out (or None) means the spec's or the
    default."""

    backend: str | None
    base_url: str | None
    model: str | None
    api_key_env: str | None  # the NAME of the variable that holds the key, never the key
    endpoint: str | None  # "chat" or "completions"
    endpoints: list[str] | tuple[str, ...] | None  # NAME=URL[,model=..]: several endpoints
    order: str | None  # "auto", "prefix" (a long shared prompt prefix together) or "input"
    mode: str | None  # "online", or "batch": the provider's Batch API
    then: str | None  # "none", or "online": what batches leave goes as ordinary requests
    batch_max_requests: int | None
    batch_max_bytes: int | None
    poll_interval: float | None
    stream: bool | None
    concurrency: int | str | None  # a number, or "auto"
    max_concurrency: int | None
    server_metrics: str | None
    rpm: float | None
    tpm: float | None
    max_attempts: int | None
    timeout: float | None
    outage_timeout: float | None
    lease: float | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    schema: str | os.PathLike[str] | None  # a JSON Schema file
    guided: bool | None
    repair_attempts: int | None
    on_truncate: str | None
    max_tokens_cap: int | None
    skip_invalid: bool | None
    redact: bool | None
    max_line_bytes: int | None
    max_input_chars: int | None
    max_input_tokens: int | None
    reuse: bool | None
    reuse_max_age: str | None
    max_total_tokens: int | None
    max_cost: float | None
    price_in: float | None
    price_out: float | None
    sim_options: dict[str, Any]


SPEC_FIELDS = {f.name: f for f in dataclasses.fields(RunSpec)}


def _coerce(name: str, value: Any) -> Any:
    """Type-check one option, so a typo in a TOML file fails with its name, not later."""
    kind = SPEC_FIELDS[name].type
    if value is None:
        return None
    if name == "concurrency" and isinstance(value, str):
        if value.strip().isdigit():
            value = int(value)
        elif value.strip().lower() == "auto":
            return "auto"
        else:
            raise OptionError(
                f"{{concurrency}} must be a number or auto, got {OptionError.quoted(value)}"
            )
    return checked(f"{{{name}}}", value, str(kind).split(" |")[0].split("[")[0])


# What a value of each kind may be given as (a float as an int too; a bool is never a number).
ACCEPTED: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "dict": (dict,),
    "tuple": (list, tuple),
}


def checked(label: str, value: Any, kind: str) -> Any:
    """`value` as a `kind` ("int", "float"...), or an OptionError naming `label`: the one type
    check for run options, spec files and simulator options alike."""
    allowed = ACCEPTED.get(kind)
    if allowed and (not isinstance(value, allowed) or (kind != "bool" and isinstance(value, bool))):
        raise OptionError(f"{label} must be {kind}, got {OptionError.quoted(value)}")
    if kind == "float" and not math.isfinite(value):  # a DataFrame's empty cell: NaN
        raise OptionError(f"{label} must be a number, got {OptionError.quoted(value)}")
    return float(value) if kind == "float" else tuple(value) if kind == "tuple" else value


def load_spec_file(path: Path) -> dict[str, Any]:
    """Read a job spec TOML; keys are option names (dashes or underscores)."""
    path = path.expanduser()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"spec file not found: {path}") from None
    except OSError as exc:
        raise UsageError(f"cannot read spec file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"spec file {path} is not valid TOML: {exc}") from None
    return {k.replace("-", "_"): v for k, v in data.items()}


def resolve(*layers: dict[str, Any], endpoint_required: bool = True) -> RunSpec:
    """Merge option layers (lowest precedence first; None means 'not given') into a RunSpec.

    Without `endpoint_required`, a spec may name no endpoint yet (backend ""): a job loaded
    with `submit --no-run`, whose endpoint is given when it runs."""
    merged: dict[str, Any] = {}
    for layer in layers:
        switched = layer.get("backend") not in (None, merged.get("backend"))
        if switched:  # a new preset brings its own URL and key variable, not the old ones
            merged.pop("base_url", None)
            merged.pop("api_key_env", None)
        if layer.get("endpoints"):  # several endpoints replace the one the job had
            for key in ("backend", "base_url", "api_key_env"):
                merged.pop(key, None)
        elif layer.get("backend") or layer.get("base_url"):  # and one replaces several
            merged.pop("endpoints", None)
        for key, value in layer.items():
            if value is None:
                continue
            if key not in SPEC_FIELDS:
                raise UsageError(f"unknown option {key!r}")
            merged[key] = _coerce(key, value)

    if merged.get("endpoints"):  # the job's own URL is its first endpoint's, for messages
        first = parse_endpoints(merged["endpoints"])[0]
        merged.setdefault("base_url", first.url)
    backend = merged.get("backend") or ("custom" if merged.get("base_url") else None)
    if backend is None and not endpoint_required:
        spec = RunSpec(**{**merged, "backend": "", "base_url": ""})
        _validate(spec, None)
        return spec
    if backend is None:
        raise OptionError(
            "no endpoint chosen: give {backend} NAME (one of "
            f"{', '.join(sorted(PRESETS))}) or {{base_url}} URL"
        )
    preset = PRESETS.get(backend)
    if preset is None:
        raise UsageError(f"unknown backend {backend!r}; choose one of {', '.join(sorted(PRESETS))}")
    merged["backend"] = backend
    if not merged.get("base_url"):
        if not preset.base_url:
            raise OptionError("{backend} custom needs {base_url}")
        merged["base_url"] = preset.base_url
    merged["base_url"] = str(merged["base_url"]).rstrip("/")
    merged.setdefault("api_key_env", preset.api_key_env)
    spec = RunSpec(**merged)
    _validate(spec, preset if endpoint_required else None)  # the key is needed when it runs
    return spec


def _validate(spec: RunSpec, preset: Preset | None) -> None:
    if spec.endpoint not in ENDPOINTS:
        raise OptionError(
            f"{{endpoint}} must be chat or completions, got {OptionError.quoted(spec.endpoint)}"
        )
    several = parse_endpoints(spec.endpoints)
    if len(several) > 1 and spec.server_metrics not in ("auto", "off"):
        raise OptionError(
            "{server_metrics} URL names one server; with several endpoints give auto or off"
        )
    for e in several:
        if e.key and (why := not_a_name(e.key)):  # not echoed, like api_key_env
            raise UsageError(f"--endpoint {e.name}: key= {why}")
        if e.backend and e.backend not in PRESETS:
            raise UsageError(f"--endpoint {e.name}: unknown backend {e.backend!r}")
    if spec.mode not in ("online", "batch") or spec.then not in ("none", "online"):
        raise OptionError("{mode} must be online or batch, and {then} none or online")
    if spec.mode == "batch" and (not spec.model or spec.endpoints):
        raise OptionError(
            "{mode} batch needs {model}, and the provider as {backend} or {base_url} (not "
            "{endpoints})"
        )
    if spec.batch_max_requests < 1 or spec.batch_max_bytes < 1000 or spec.poll_interval <= 0:
        raise OptionError(
            "{batch_max_requests} must be at least 1, {batch_max_bytes} at least 1000 and "
            "{poll_interval} positive"
        )
    if spec.order not in ORDERS:
        raise OptionError(f"{{order}} must be one of {', '.join(ORDERS)}")
    if isinstance(spec.concurrency, int) and spec.concurrency < 1:
        raise OptionError("{concurrency} must be at least 1")
    if spec.max_concurrency < 1:
        raise OptionError("{max_concurrency} must be at least 1")
    metrics = spec.server_metrics
    if metrics not in ("auto", "off") and url_problem(metrics) is not None:
        got = "a URL with a user:password@" if "@" in metrics else OptionError.quoted(metrics)
        raise OptionError(f"{{server_metrics}} must be auto, off or an http(s) URL, got {got}")
    # these URLs are never shown: one may hold a user:password@
    for e in parse_endpoints(spec.endpoints):  # first: the job's base URL is the first's
        if (problem := url_problem(e.url)) is not None:
            raise UsageError(f"--endpoint {e.name}: its URL {problem}")
    if spec.base_url and (problem := url_problem(spec.base_url)) is not None:
        raise OptionError(f"{{base_url}} {problem}")
    for name in ("rpm", "tpm"):
        value = getattr(spec, name)
        if value is not None and value <= 0:
            raise OptionError(f"{{{name}}} must be positive")
    if spec.max_attempts < 1:
        raise OptionError("{max_attempts} must be at least 1")
    if spec.repair_attempts < 0:
        raise OptionError("{repair_attempts} must be 0 or more")
    if spec.on_truncate not in ON_TRUNCATE:
        raise OptionError(f"{{on_truncate}} must be one of {', '.join(ON_TRUNCATE)}")
    if spec.max_tokens_cap < 1:
        raise OptionError("{max_tokens_cap} must be at least 1")
    if spec.timeout <= 0:
        raise OptionError("{timeout} must be positive")
    if spec.outage_timeout < 0:
        raise OptionError("{outage_timeout} must be 0 or more")
    if spec.lease < 1:
        raise OptionError("{lease} must be at least 1 second")
    if spec.max_cost is not None and spec.price_in is None and spec.price_out is None:
        raise OptionError("{max_cost} needs {price_in} and {price_out} (per million tokens)")
    budget = "max_total_tokens" if spec.max_total_tokens is not None else "max_cost"
    if getattr(spec, budget) is not None and spec.max_tokens is None:
        # an answer's length bounds what a request may cost: without it no estimate holds
        raise OptionError(
            f"{{{budget}}} needs {{max_tokens}}: without it an answer's length has no bound, "
            "and one answer could pass the budget (a line's own max_tokens still wins)"
        )
    for name in ("max_cost", "price_in", "price_out"):
        if (getattr(spec, name) or 0) < 0:
            raise OptionError(f"{{{name}}} must be 0 or more")
    limits = ("max_tokens", "max_line_bytes", "max_input_chars", "max_input_tokens")
    for name in (*limits, "max_total_tokens"):
        value = getattr(spec, name)
        if value is not None and value < 1:
            raise OptionError(f"{{{name}}} must be at least 1")
    if spec.api_key_env and (why := not_a_name(spec.api_key_env)):
        # not echoed: a key pasted where its variable's name goes must not reach a log
        raise OptionError("{api_key_env} " + why)
    if preset is not None and preset.key_required and spec.api_key() is None:
        raise OptionError(
            f"backend {preset.name} needs an API key: set the environment variable "
            f"{spec.api_key_env} (or name another with {{api_key_env}})"
        )


def preset_for(spec: RunSpec) -> Preset:
    return PRESETS[spec.backend]
