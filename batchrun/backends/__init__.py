"""Backends: the only code that imports httpx."""

from batchrun.backends.base import Backend, Completion, CompletionRequest, Transport
from batchrun.backends.openai_compat import ENDPOINT_PATHS, OpenAICompatBackend

__all__ = [
    "ENDPOINT_PATHS",
    "Backend",
    "Completion",
    "CompletionRequest",
    "OpenAICompatBackend",
    "Transport",
]
