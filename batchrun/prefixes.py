"""Prefix groups: lines whose prompts start with the same long text (a system prompt, few-shot
examples, a document asked several questions), so that they can be sent close together.

Engines keep the key/value state of recent prompt prefixes (vLLM's automatic prefix caching,
SGLang's radix cache, llama-server's per-slot prompt cache): a request whose prefix is still
cached skips its prefill. Sent in input order, a file that mixes twenty system prompts evicts
each one before it comes again; sent grouped, each is computed about once.

A line's key is a hash of the first PREFIX_CHARS characters of its prompt (roles and contents
in order), for prompts longer than that; shorter prompts have no group. PREFIX_CHARS is about
500 tokens at 4 characters a token: published measurements find no gain from sharing prefixes
of ~130 tokens, and a key this long never joins prompts that share only a greeting.

The claim order (`sched`, an integer) puts each group right after its first line, in input
order within the group: `(lead << 32) | line`, where `lead` is the group's first line (the
line itself without a group). Nothing waits behind a group for longer than the group takes,
and results are still written in input order. The sender holds a group's later lines until
its first line's request has its first token (sender.py), so the prefix is computed once.
"""

from __future__ import annotations

import hashlib
from typing import Any

PREFIX_CHARS = 2048
LINE_BITS = 32  # a line's number in the low bits; lines below 2**31 keep it a signed int64


def prefix_key(body: dict[str, Any]) -> int | None:
    """The hash of the prompt's first PREFIX_CHARS characters; None for a shorter prompt."""
    text = _leading_text(body)
    if text is None:
        return None
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _leading_text(body: dict[str, Any]) -> str | None:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:PREFIX_CHARS] if len(prompt) > PREFIX_CHARS else None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        for piece in (str(message.get("role")), "\x1f", *_contents(message.get("content")), "\x1e"):
            parts.append(piece)
            size += len(piece)
        if size > PREFIX_CHARS:
            return "".join(parts)[:PREFIX_CHARS]
    return None


def _contents(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
    return []


def in_input_order(line: int) -> int:
    return (line << LINE_BITS) | line


class Grouper:
    """Claim positions for lines in input order, and how many groups of two or more lines it
    found."""

    def __init__(self) -> None:
        self._lead: dict[int, int] = {}  # prefix key -> the first line that had it
        self._many: set[int] = set()  # keys of two lines or more
        self.groups = 0  # prefixes that two or more lines share
        self.grouped = 0  # lines in such groups

    def position(self, line: int, key: int | None) -> int:
        if key is None:
            return in_input_order(line)
        lead = self._lead.setdefault(key, line)
        if lead != line:
            if key in self._many:
                self.grouped += 1
            else:
                self._many.add(key)
                self.groups += 1
                self.grouped += 2
        return (lead << LINE_BITS) | line
