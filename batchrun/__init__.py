"""batchrun: push large JSONL files of prompts through OpenAI-compatible endpoints, durably."""

__version__ = "0.1.0"
