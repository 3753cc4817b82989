"""Backends: the only code that imports httpx."""

from batchrun.backends.base import Backend, Completion, CompletionRequest, RateInfo, Transport
from batchrun.backends.metrics_reader import MetricsReader
from batchrun.backends.openai_compat import ENDPOINT_PATHS, OpenAICompatBackend

__all__ = [
    "ENDPOINT_PATHS",
    "Backend",
    "Completion",
    "CompletionRequest",
    "MetricsReader",
    "OpenAICompatBackend",
    "RateInfo",
    "Transport",
]
