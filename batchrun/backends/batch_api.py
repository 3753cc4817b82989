"""A provider's Files and Batches endpoints (OpenAI's Batch API), for `--mode batch`
(hosted.py): upload a JSONL file, create a batch with metadata, look at it, find it again by its
metadata, download its output, cancel it. Errors are the backend's own (errors_http.py)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import httpx
import orjson

from batchrun.backends.base import Transport, auth_headers
from batchrun.backends.build import checked_key, sim_transport
from batchrun.backends.errors_http import error_for_status, scrubbed
from batchrun.config import RunSpec, preset_for
from batchrun.errors import FatalError

# Batches looked through (100 a page) for one whose metadata names a chunk: past them, with the
# chunk's time not reached, the look stops the run rather than say "none" (a second batch).
LIST_PAGES = 1000


class Unreadable(FatalError):
    """A 2xx whose answer is not OpenAI's shape: whatever it did (a batch created?) is unknown."""


class BatchAPI:
    """The provider's Files and Batches endpoints, at the job's URL, with its key."""

    def __init__(self, spec: RunSpec, transport: Transport | None = None) -> None:
        key = checked_key(spec)
        headers = auth_headers(preset_for(spec).auth, key)
        # a server may echo the key, and the URL may hold a user:password: hidden in errors
        self._secrets = (key, httpx.URL(spec.base_url).userinfo.decode())
        self._client = httpx.AsyncClient(
            base_url=spec.base_url.removesuffix("/v1") + "/v1",
            headers=headers,
            transport=transport or sim_transport(spec),
            timeout=spec.timeout,
        )

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            error = error_for_status(503, {}, str(exc).encode(), path)
            raise scrubbed(error, *self._secrets) from None
        if response.status_code >= 300:  # a redirect too: not followed
            url = str(response.request.url)
            error = error_for_status(response.status_code, response.headers, response.content, url)
            raise scrubbed(error, *self._secrets)
        return response

    async def _object(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """A call's answer: a JSON object with a string `id` (a file, a batch), else the
        provider's shape is not OpenAI's and the job stops saying so: a guess could lose
        track of a batch that is being paid for. A batch's `status` comes lower-cased."""
        response = await self._call(method, path, **kwargs)
        try:
            data = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            raise scrubbed(
                Unreadable(
                    f"{method} {path} did not answer an object with an id, as "
                    f"OpenAI's Batch API does: {response.content[:200]!r}"
                ),
                *self._secrets,
            )
        return _lowered(data)

    async def upload(self, name: str, content: bytes) -> str:
        files = {"file": (name, content, "application/jsonl")}
        file = await self._object("POST", "/files", data={"purpose": "batch"}, files=files)
        return str(file["id"])

    async def create(self, file_id: str, endpoint: str, metadata: dict[str, str]) -> Any:
        body = {
            "input_file_id": file_id,
            "endpoint": endpoint,
            "completion_window": "24h",
            "metadata": metadata,
        }
        return await self._object("POST", "/batches", json=body)

    async def get(self, batch_id: str) -> Any:
        return await self._object("GET", f"/batches/{batch_id}")

    async def cancel(self, batch_id: str) -> Any:
        return await self._object("POST", f"/batches/{batch_id}/cancel")

    async def content(self, file_id: str) -> bytes:
        return (await self._call("GET", f"/files/{file_id}/content")).content

    async def find(self, metadata: dict[str, str], since: float) -> Any | None:
        """The newest batch whose metadata holds these pairs, or None; batches are listed
        newest first, and the search stops at those made before `since` (epoch seconds, an
        hour's leeway for clocks), or at the list's end. Not there after LIST_PAGES pages, it
        cannot say, and raises: "none" would make a second batch of the same lines."""
        after: str | None = None
        for _ in range(LIST_PAGES):
            params = {"limit": 100, **({"after": after} if after else {})}
            page, more = _listed(await self._call("GET", "/batches", params=params))
            for batch in page:
                found = batch.get("metadata")
                named = isinstance(found, dict) and metadata.items() <= found.items()
                if named and isinstance(batch.get("id"), str):
                    return _lowered(batch)
                made = _epoch(batch.get("created_at"))
                if made is not None and made < since - 3600:
                    return None
            if not more or not page or not isinstance(page[-1].get("id"), str):
                return None
            after = page[-1]["id"]
        raise FatalError(
            f"looked through {LIST_PAGES * 100:,} batches for the one this job made, and did "
            "not reach the time it was made: whether it exists is not known, so none is made "
            "again; `batchrun cancel JOB --forget` gives its lines up to be sent again"
        )

    async def aclose(self) -> None:
        await self._client.aclose()


def _lowered(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch (or file) with its `status` lower-cased: some copies of the API say COMPLETED."""
    if isinstance(batch.get("status"), str):
        batch["status"] = batch["status"].lower()
    return batch


def _listed(response: httpx.Response) -> tuple[list[dict[str, Any]], bool]:
    """A list page's batches (objects only), and whether more pages follow."""
    try:
        page = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        page = None
    data = page.get("data") if isinstance(page, dict) else None
    if not isinstance(data, list):  # not "no batch": a second one would be paid for
        path = response.request.url.path
        raise Unreadable(f"GET {path} did not answer a list of batches (`data`), as OpenAI's does")
    assert isinstance(page, dict)
    return [b for b in data if isinstance(b, dict)], bool(page.get("has_more"))


def _epoch(value: Any) -> float | None:
    """A `created_at` in epoch seconds (OpenAI's), or an ISO 8601 time (some copies'); None
    when it is neither."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            made = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        # without a zone: UTC, as servers write times (not this machine's zone)
        return (made if made.tzinfo else made.replace(tzinfo=UTC)).timestamp()
    return None
