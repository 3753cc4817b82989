"""A provider's Files and Batches endpoints (OpenAI's Batch API), for `--mode batch`
(hosted.py): upload a JSONL file, create a batch with metadata, look at it, find it again by its
metadata, download its output, cancel it. Errors are the backend's own (errors_http.py)."""

from __future__ import annotations

from typing import Any

import httpx

from batchrun.backends.base import Transport, auth_headers
from batchrun.backends.build import checked_key, sim_transport
from batchrun.backends.errors_http import error_for_status
from batchrun.config import RunSpec, preset_for

LIST_PAGES = 50  # batches looked through (100 a page) for one whose metadata names a chunk


class BatchAPI:
    """The provider's Files and Batches endpoints, at the job's URL, with its key."""

    def __init__(self, spec: RunSpec, transport: Transport | None = None) -> None:
        headers = auth_headers(preset_for(spec).auth, checked_key(spec))
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
            raise error_for_status(503, {}, str(exc).encode(), path) from None
        if response.status_code >= 300:  # a redirect too: not followed
            url = str(response.request.url)
            raise error_for_status(response.status_code, response.headers, response.content, url)
        return response

    async def upload(self, name: str, content: bytes) -> str:
        files = {"file": (name, content, "application/jsonl")}
        response = await self._call("POST", "/files", data={"purpose": "batch"}, files=files)
        return str(response.json()["id"])

    async def create(self, file_id: str, endpoint: str, metadata: dict[str, str]) -> Any:
        body = {
            "input_file_id": file_id,
            "endpoint": endpoint,
            "completion_window": "24h",
            "metadata": metadata,
        }
        return (await self._call("POST", "/batches", json=body)).json()

    async def get(self, batch_id: str) -> Any:
        return (await self._call("GET", f"/batches/{batch_id}")).json()

    async def cancel(self, batch_id: str) -> Any:
        return (await self._call("POST", f"/batches/{batch_id}/cancel")).json()

    async def content(self, file_id: str) -> bytes:
        return (await self._call("GET", f"/files/{file_id}/content")).content

    async def find(self, metadata: dict[str, str], since: float) -> Any | None:
        """The newest batch whose metadata holds these pairs, or None; batches are listed
        newest first, and the search stops at those made before `since` (epoch seconds, an
        hour's leeway for clocks)."""
        after: str | None = None
        for _ in range(LIST_PAGES):
            params = {"limit": 100, **({"after": after} if after else {})}
            page = (await self._call("GET", "/batches", params=params)).json()
            for batch in page.get("data", []):
                if metadata.items() <= (batch.get("metadata") or {}).items():
                    return batch
                if (batch.get("created_at") or since) < since - 3600:
                    return None
            if not page.get("has_more") or not page.get("data"):
                return None
            after = page["data"][-1]["id"]
        return None

    async def aclose(self) -> None:
        await self._client.aclose()
