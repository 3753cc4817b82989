"""Several endpoints for one job, as the command line and spec files name them:

    NAME=URL[,model=M][,key=VAR][,backend=PRESET][,weight=W][,rpm=R][,tpm=T]

`key` is the NAME of the environment variable that holds the endpoint's API key (never the key:
a job's key never goes to another endpoint's host). `weight` orders endpoints that have a free
slot at once (the fewest requests in flight per unit of weight goes first); weight 0 makes an
endpoint a fallback, sent to only while every weighted endpoint is down or taken out. `rpm` and
`tpm` pace that endpoint alone (the job's --rpm/--tpm apply to each endpoint otherwise).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from batchrun.errors import UsageError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SYNTAX = "NAME=URL[,model=M][,key=VAR][,backend=PRESET][,weight=W][,rpm=R][,tpm=T]"
TEXT_PARTS = ("model", "key", "backend")
NUMBER_PARTS = ("weight", "rpm", "tpm")


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    name: str
    url: str
    model: str | None = None
    key: str | None = None  # the environment variable's name
    backend: str | None = None  # a preset; "custom" when left out
    weight: float = 1.0
    rpm: float | None = None
    tpm: float | None = None


def is_endpoint(text: str) -> bool:
    """`--endpoint` also takes the API kind (chat, completions); an endpoint has NAME=URL."""
    return "=" in text


def parse_endpoint(text: str) -> EndpointSpec:
    name, sep, rest = text.partition("=")
    if not sep or not NAME.fullmatch(name.strip()) or not rest.strip():
        shown = name.strip() if NAME.fullmatch(name.strip()) else "?"  # never a stray key
        raise UsageError(f"--endpoint {shown}: write {SYNTAX}, NAME of 1-64 letters, digits, ._-")
    url, *extras = rest.split(",")
    texts: dict[str, str] = {}
    numbers: dict[str, float] = {}
    for position, extra in enumerate(extras, start=2):
        key, sep, value = (part.strip() for part in extra.partition("="))
        if not sep or key not in TEXT_PARTS + NUMBER_PARTS or not value:
            # not the part's text: it may be a key pasted in the wrong place
            known = ", ".join(f"{k}=" for k in TEXT_PARTS + NUMBER_PARTS)
            raise UsageError(
                f"--endpoint {name.strip()}: part {position} is not one of {known} with a value"
            )
        if key in TEXT_PARTS:
            texts[key] = value
        else:
            numbers[key] = _number(name.strip(), key, value)
    if numbers.get("rpm") == 0 or numbers.get("tpm") == 0:
        raise UsageError(f"--endpoint {name.strip()}: rpm and tpm must be above 0")
    return EndpointSpec(
        name.strip(),
        url.strip().rstrip("/"),
        model=texts.get("model"),
        key=texts.get("key"),
        backend=texts.get("backend"),
        weight=numbers.get("weight", 1.0),
        rpm=numbers.get("rpm"),
        tpm=numbers.get("tpm"),
    )


def _number(name: str, key: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0:  # the value not echoed: it may be a key
        raise UsageError(f"--endpoint {name}: {key} must be a number of at least 0")
    return number


def parse_endpoints(texts: tuple[str, ...] | list[str]) -> list[EndpointSpec]:
    """Every endpoint of a job, checked as a set: names unique, some weight above 0."""
    endpoints = [parse_endpoint(text) for text in texts]
    names = [e.name for e in endpoints]
    if len(set(names)) < len(names):
        raise UsageError("two endpoints have the same name; name each one differently")
    if endpoints and not any(e.weight > 0 for e in endpoints):
        raise UsageError("every endpoint has weight 0: give at least one a weight above 0")
    return endpoints


def not_a_name(text: str) -> str | None:
    """Why `text` cannot be taken for the NAME of the environment variable that holds a key
    (it may be the key, pasted in its place: never echoed), or None. A valid name that names
    no variable set here and looks like a random token is taken for a key: a Groq key (`gsk_`
    and 52 letters and digits) or a hex key is a valid name."""
    if not ENV_NAME.fullmatch(text):
        return (
            "must be the NAME of an environment variable (letters, digits and _), not the key "
            "itself"
        )
    if text not in os.environ and _token_like(text):
        return (
            "names no variable set here and looks like a key (not shown): if it is a "
            "variable's name, set the environment variable; if it is a key, put it in one and "
            "give that variable's name"
        )
    return None


def _token_like(text: str) -> bool:
    """What a random key has, and a name of words joined by `_` does not: a run of 16 or more
    characters without `_`, in upper and lower case or holding a digit."""
    return any(
        len(part) >= 16
        and (any(ch.isdigit() for ch in part) or part not in (part.upper(), part.lower()))
        for part in text.split("_")
    )


def url_problem(url: str) -> str | None:
    """Why `url` is not an http(s) URL a request can be sent to, or None. Never echoes the URL
    (it may hold a `user:password@`)."""
    if url.partition("://")[0].lower() not in ("http", "https"):  # a scheme is any case
        return "must be an http:// or https:// URL"
    if not url.isprintable() or any(ch.isspace() for ch in url):
        return "has a space or a control character in it"
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises here
    except ValueError as exc:
        return f"is not a URL that can be read ({exc})"
    return None if parts.hostname else "names no host"


def shown_endpoint(url: str) -> str:
    """An endpoint's URL as it may be shown: a `user:password@` in it becomes `***@`."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()


def host_port(url: str) -> str:
    """What names an endpoint given by URL alone: its host and port (never its credentials)."""
    return urlsplit(url).netloc.rpartition("@")[2] or url
