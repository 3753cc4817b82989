"""Rows handed over from Python, written as a job's input file: a job always reads a file,
so a resume reads exactly what was submitted."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from batchrun import jobs as verbs
from batchrun.config import ANSWER_FIELDS, load_spec_file
from batchrun.errors import OutputError, UsageError
from batchrun.inputs import file_digest
from batchrun.jobs import Home
from batchrun.ledger import Job, Ledger

PathLike = str | os.PathLike[str]
ROWS_FILE = re.compile(r"rows-[0-9a-f]{16}\.jsonl")  # what rows are written to, in inputs/

# Options that change what is asked, or of whom: rows submitted again with other values are
# another job (`endpoints` names each endpoint's model; the simulator's options its answers).
REQUEST_SHAPING = ("backend", "base_url", "endpoints", "sim_options", *ANSWER_FIELDS)


def option_layers(spec: PathLike | None, options: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The run's options as resolve() takes them: a spec file's, then the keywords given."""
    if spec is not None and not isinstance(spec, (str, os.PathLike)):
        raise UsageError(f"spec must be a path to a TOML file, not {type(spec).__name__}")
    layers = [load_spec_file(Path(spec))] if spec is not None else []
    given = dict(options)
    if isinstance(given.get("schema"), os.PathLike):
        given["schema"] = os.fspath(given["schema"])
    layers.append(given)
    return layers


def input_of(
    source: PathLike | Iterable[Mapping[str, Any]],
    where: Home,
    job: str | None,
    layers: list[dict[str, Any]],
) -> tuple[Path, str]:
    """The input file and the job's name (rows are written to HOME/inputs/ first, their
    options checked before: they name the job)."""
    if job is not None:
        verbs.check_job_name(job)  # before anything is written
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        return path, job or verbs.check_job_name(verbs.default_job_name(path))
    verbs.resolve_for_job(None, *layers, endpoint_required=False)  # a bad option: said first
    merged = {k: v for layer in layers for k, v in layer.items() if v is not None}
    path, digest = write_rows(source, where.root / "inputs", merged)
    return path, job or f"rows-{digest[:12]}"


def write_rows(
    rows: Iterable[Mapping[str, Any]], folder: Path, options: Mapping[str, Any]
) -> tuple[Path, str]:
    """Write `rows` as JSONL under `folder`, named by their content; returns the file and the
    digest that names a job of these rows with these options (`rows-` + its first 12 digits).

    The file's name holds the content's digest, so rows that differ never share a file, and a
    submit that fails leaves nothing in the way of the next."""
    if isinstance(rows, (Mapping, str, bytes, bytearray)) or not isinstance(rows, Iterable):
        raise UsageError(
            "source must be a JSONL path or an iterable of dicts, one per line (for one row: "
            f"[row]), not {type(rows).__name__}"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=folder, suffix=".tmp")
    except OSError as exc:
        raise OutputError(f"cannot write the rows to {folder}: {exc.strerror or exc}") from None
    tmp = Path(name)
    try:
        content = hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            for number, row in enumerate(rows, 1):
                line = _line(number, row)
                content.update(line)
                f.write(line)
        digest = content.hexdigest()
        path = folder / f"rows-{digest[:16]}.jsonl"
        os.replace(tmp, path)  # the same content again: the same bytes, nothing changes
    except OSError as exc:  # a full disk
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write the rows to {folder}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    asked = {key: options[key] for key in REQUEST_SHAPING if options.get(key) is not None}
    if isinstance(asked.get("schema"), str):  # the schema's content, as reuse digests it
        asked["schema"] = _content(asked["schema"])
    shaped = orjson.dumps(asked, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    job = hashlib.sha256(digest.encode() + shaped)
    return path, job.hexdigest()


def _content(path: str) -> str:
    """A file's digest, so that an edited file is another ask; its path if it can't be read
    (resolving the options says why)."""
    try:
        return file_digest(Path(path).expanduser())
    except OSError:
        return path


def _line(number: int, row: Any) -> bytes:
    if not isinstance(row, Mapping):
        raise UsageError(f"row {number} is {type(row).__name__}, not a dict")
    try:
        return orjson.dumps(dict(row), option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
    except TypeError as exc:
        raise UsageError(f"row {number} cannot be written as JSON: {exc}") from None


def rows_job(led: Ledger, name: str) -> tuple[str, Job | None]:
    """The name batchrun gave rows, and its job; where `gc` collected that job, the next name
    it did not collect (`-2`, `-3`...): the same call on a later night runs, and its unchanged
    rows take the answers `gc` kept."""
    base, n = name, 1
    while (found := led.get_job(name)) is not None:
        if not found.collected(sum(led.counts(name).values())):
            break
        n += 1
        name = f"{base}-{n}"
    return name, found
