"""What a simulator's settings must be, checked once for the `batchrun sim` command and for a
spec file's `sim_options` alike: a setting accepted and then failing on the first request
would take the server (or the run) down with it."""

from __future__ import annotations

from batchrun.sim.model import SimConfig

# The type of the settings whose default is None (not set): the others' is their default's.
OPTIONAL_KINDS = {
    "slots": "int",
    "queue_limit": "int",
    "rpm": "int",
    "tpm": "int",
    "api_key": "str",
    "json_schema": "dict",
}
AT_LEAST_ONE = ("slots", "rpm", "tpm", "batch_max_requests")  # when set
NOT_NEGATIVE = (
    "ttft_ms",
    "prefill_ms_per_token",
    "tpot_ms",
    "min_output_tokens",
    "retry_after_ms",
    "tpot_slope",
    "queue_limit",
    "prefix_cache_blocks",
    "batch_seconds",
    "batch_window_s",
)


def config_problem(config: SimConfig) -> str | None:
    """Why these settings cannot serve a request, naming the setting; None if they can."""
    for name in AT_LEAST_ONE:
        value = getattr(config, name)
        if value is not None and value < 1:
            return f"{name} must be at least 1, got {value}"
    for name in NOT_NEGATIVE:
        value = getattr(config, name)
        if value is not None and value < 0:
            return f"{name} must not be negative, got {value}"
    if config.max_output_tokens < max(1, config.min_output_tokens):
        return (
            f"max_output_tokens ({config.max_output_tokens}) must be at least 1 and at least "
            f"min_output_tokens ({config.min_output_tokens})"
        )
    if not config.models:
        return "models must name at least one model"
    idle = [name for name, unset in _NEED_SLOTS.items() if getattr(config, name) != unset]
    if config.slots is None and idle:  # accepted, and then nothing would happen
        return f"{', '.join(idle)} without slots does nothing: give slots too"
    return None


# Capacity settings that only a batch of `slots` gives meaning to, with their value when unset.
_NEED_SLOTS = {"queue_limit": None, "tpot_slope": 0.0, "gate_status": 429}
