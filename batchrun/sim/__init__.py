"""The simulator: a pure latency model served as an httpx transport and as an HTTP server."""

from batchrun.sim.model import Reply, SimConfig, SimModel, prompt_tag, prompt_text
from batchrun.sim.server import SimServer
from batchrun.sim.transport import SimTransport

__all__ = [
    "Reply",
    "SimConfig",
    "SimModel",
    "SimServer",
    "SimTransport",
    "prompt_tag",
    "prompt_text",
]
