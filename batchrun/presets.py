"""Known servers: where each usually listens, its key variable, how it takes the key and a
schema. A new server with its own quirks is one entry here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """What a known server needs: where it usually listens, its key variable, its quirks."""

    name: str
    base_url: str
    api_key_env: str | None
    key_required: bool = False
    auth: str = "bearer"  # how the key is sent: a style in backends/base.py AUTH_STYLES
    protocol: str = "openai"  # what it speaks: a backend in backends/build.py BACKENDS
    stream_options: bool = True  # accepts stream_options: {"include_usage": true}
    # How it takes a JSON Schema for constrained decoding: response_format type "json_schema"
    # (OpenAI, vLLM, SGLang, Groq, Ollama) or "json_object" with a "schema" (llama.cpp).
    guided_style: str = "json_schema"
    note: str = ""

    @property
    def at_its_address(self) -> bool:
        """A service that lives at its own address (a hosted API, the in-process simulator),
        unlike an engine run anywhere: a base URL given later, elsewhere, is another server."""
        return self.key_required or self.name == "sim"


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "vllm",
            "http://127.0.0.1:8000/v1",
            "VLLM_API_KEY",
            note="vllm serve MODEL; key only if started with --api-key",
        ),
        Preset(
            "sglang",
            "http://127.0.0.1:30000/v1",
            "SGLANG_API_KEY",
            note="python -m sglang.launch_server; key only if started with --api-key",
        ),
        Preset(
            "llamacpp",
            "http://127.0.0.1:8080/v1",
            "LLAMACPP_API_KEY",
            guided_style="json_object",
            note="llama-server or python -m llama_cpp.server; serves one model",
        ),
        Preset(
            "ollama",
            "http://127.0.0.1:11434/v1",
            None,
            note="ollama serve; model names like llama3.2:1b",
        ),
        Preset("groq", "https://api.groq.com/openai/v1", "GROQ_API_KEY", key_required=True),
        Preset("openai", "https://api.openai.com/v1", "OPENAI_API_KEY", key_required=True),
        Preset(
            "sim",
            "http://sim.batchrun.invalid/v1",
            None,
            note="in-process simulator; outputs are synthetic",
        ),
        Preset("custom", "", None, note="any OpenAI-compatible server given by --base-url"),
    )
}
