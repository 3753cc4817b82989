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
from urllib.parse import urlsplit

from batchrun.endpoints import parse_endpoints
from batchrun.errors import OptionError, UsageError
from batchrun.presets import PRESETS, Preset
from batchrun.spec_rules import validate

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
        if value.strip().isdecimal():  # not isdigit: '²' is a digit int() refuses
            value = int(value)
        elif value.strip().lower() == "auto":
            return "auto"
        else:
            raise OptionError(
                f"{{concurrency}} must be a number or auto, got {OptionError.quoted(value)}"
            )
    value = checked(f"{{{name}}}", value, str(kind).split(" |")[0].split("[")[0])
    if name == "endpoints" and not all(isinstance(e, str) for e in value):  # TOML tables
        raise OptionError('{endpoints} must be a list of "NAME=URL[,model=M,...]" strings')
    return value


# What a value of each kind may be given as (a float as an int too; a bool is never a number).
ACCEPTED: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "dict": (dict,),
    "tuple": (list, tuple),
}


# Options whose value may hold a secret (a URL's user:password@, a key pasted for a name):
# a wrong one is refused by its type, never echoed.
UNSHOWN = {
    f"{{{k}}}" for k in ("base_url", "endpoints", "endpoint", "api_key_env", "server_metrics")
}


def checked(label: str, value: Any, kind: str) -> Any:
    """`value` as a `kind` ("int", "float"...), or an OptionError naming `label`: the one type
    check for run options, spec files and simulator options alike."""
    allowed = ACCEPTED.get(kind)
    if allowed and (not isinstance(value, allowed) or (kind != "bool" and isinstance(value, bool))):
        shown = f"a {type(value).__name__}" if label in UNSHOWN else OptionError.quoted(value)
        raise OptionError(f"{label} must be {kind}, got {shown}")
    if kind == "int" and not -(2**63) <= value < 2**63:
        raise OptionError(f"{label} is out of range (at most {2**63 - 1:,})")
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
    options = {k.replace("-", "_"): v for k, v in data.items()}
    if len(options) < len(data):  # max_tokens and max-tokens: which one is meant?
        twice = sorted({k for k in options if k in data and k.replace("_", "-") in data})
        raise UsageError(f"spec file {path} gives {', '.join(twice)} twice (with - and with _)")
    if "quiet" in options:  # how the command speaks, not what the job does
        raise UsageError(f"spec file {path}: quiet is not a job option; give --quiet instead")
    schema = options.get("schema")
    if isinstance(schema, str) and schema and not Path(schema).expanduser().is_absolute():
        options["schema"] = str(path.parent / schema)  # beside the spec, wherever cron runs
    return options


def resolve(
    *layers: dict[str, Any], endpoint_required: bool = True, stored: bool = False
) -> RunSpec:
    """Merge option layers (lowest precedence first; None means 'not given') into a RunSpec.

    Without `endpoint_required`, a spec may name no endpoint yet (backend ""): a job loaded
    with `submit --no-run`, whose endpoint is given when it runs. `stored`: a job's own spec,
    read back (its key variable was checked where it was given, and need not be set here)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        _moved(merged, layer)
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
        validate(spec, None, stored=stored)
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
    needs_key = preset if endpoint_required else None  # the key is needed when it runs
    validate(spec, needs_key, stored=stored)
    return spec


def _moved(merged: dict[str, Any], layer: dict[str, Any]) -> None:
    """Before `layer` is laid over `merged`: where it names another server, what belonged to
    the old one goes. A new preset over an earlier one brings its own URL and key variable
    (over a URL and key given, a spec file's or a custom job's, it only adds its quirks). A
    URL elsewhere over a service at its own address (a hosted API's, the simulator's) is
    another server: a custom one, and the hosted key variable is not sent there unless this
    layer names it. A load page URL (--server-metrics) was the old server's too: `auto`
    reads the new one's."""
    before, url, old_url = merged.get("backend"), layer.get("base_url"), merged.get("base_url")
    moved = bool(url and old_url) and _host(str(url)) != _host(str(old_url))
    switched = layer.get("backend") not in (None, before)
    page = merged.get("server_metrics") not in (None, "auto", "off")
    if (moved or switched or layer.get("endpoints")) and page and not layer.get("server_metrics"):
        merged.pop("server_metrics")
    preset = PRESETS.get(str(before))
    if before is not None and switched:  # what the old preset brought goes; a URL given stays
        # (with several endpoints the stored URL is the first's, kept for messages only)
        own = preset.base_url if preset is not None else None
        if own is None or moved or merged.get("endpoints") or str(old_url or "").rstrip("/") == own:
            merged.pop("base_url", None)  # ... and a key variable goes with its URL: an
            merged.pop("api_key_env", None)  # OpenAI key must not follow the job to Groq
        return
    if not url or layer.get("backend") or preset is None or not preset.at_its_address:
        return
    if _host(url) != _host(merged.get("base_url") or preset.base_url):
        merged["backend"] = "custom"
        merged.pop("api_key_env", None)


def _host(url: str) -> tuple[str | None, int | None]:
    try:
        parts = urlsplit(str(url))
        return parts.hostname, parts.port
    except ValueError:  # a port that is not a number: url_problem says so later
        return None, None


def preset_for(spec: RunSpec) -> Preset:
    return PRESETS[spec.backend]
