"""An engine's prefix cache, for the simulator: prompts that share a start skip its prefill.

vLLM (automatic prefix caching), SGLang (its radix cache) and llama-server (slot reuse) keep the
KV cache of prompts they have read and reuse it for a later prompt that starts the same way, so
a batch whose requests share a long system prompt gets its first tokens sooner. Modelled here as
vLLM does it: the prompt is cut into fixed-size blocks, and each block's key hashes the block
with the previous block's key, so a block matches only when everything before it matches too.
Only full blocks are cached; the cache holds a bounded number of them and evicts the least
recently used. A prompt's tail blocks are evicted before its head (vLLM frees a request's
blocks in reverse order for the same reason): the head is what the next prompt can reuse.

Pure and clock-free: the cache changes only when told a request was taken. Blocks count as
cached from the moment their request is admitted, as vLLM V1 caches blocks when it schedules
them; a request still queued behind full slots already lends its blocks, a small optimism.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

# The project's estimate of a token's size (batchrun.inputs.estimate_tokens: characters / 4).
CHARS_PER_TOKEN = 4
# vLLM hashes blocks of 16 tokens; 64 keeps the key count per prompt small for a simulator.
BLOCK_TOKENS = 64
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN

# vLLM's own help texts (vllm/v1/metrics/loggers.py); both count tokens, not requests.
_COUNTERS = {
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
}


class PrefixCache:
    """A bounded LRU set of chained block keys; `capacity_blocks` <= 0 turns it off."""

    def __init__(self, *, capacity_blocks: int, block_chars: int = BLOCK_CHARS) -> None:
        if block_chars < 1:
            raise ValueError(f"block_chars must be at least 1, got {block_chars}")
        self.capacity_blocks = max(0, capacity_blocks)
        self.block_chars = block_chars
        self._blocks: OrderedDict[bytes, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, text: str) -> int:
        """How many leading characters of `text` are cached: its longest run of leading blocks
        present, in whole blocks. Changes nothing, so a refused request leaves no trace; hashing
        stops at the first miss."""
        run = 0
        for key in self._keys(text):
            if key not in self._blocks:
                break
            run += 1
        return run * self.block_chars

    def insert(self, text: str) -> None:
        """Cache (or refresh) every full block of `text`, then evict past the capacity.

        Blocks go in last to first, so the head ends most recently used and a prompt too long
        for the cache keeps its head; blocks past the capacity are not even hashed."""
        keys = list(islice(self._keys(text), self.capacity_blocks))
        for key in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def lookup_and_insert(self, text: str) -> int:
        """`lookup`, then `insert`: the cached characters a request found, as it is taken."""
        cached = self.lookup(text)
        self.insert(text)
        return cached

    def _keys(self, text: str) -> Iterator[bytes]:
        """The chained keys of the full blocks of `text`, first to last, computed lazily."""
        if self.capacity_blocks == 0:
            return
        key = b""
        size = self.block_chars
        for start in range(0, len(text) - size + 1, size):
            block = text[start : start + size].encode("utf-8", "surrogatepass")
            key = hashlib.blake2b(key + block, digest_size=16).digest()
            yield key


def words_within(text: str, chars: int) -> int:
    """The sim's tokens (whitespace-separated words) lying wholly in the first `chars`
    characters: a word the boundary cuts has to be read again, so it is not cached."""
    if chars <= 0:
        return 0
    head = text[:chars]
    cut = chars < len(text) and not head[-1].isspace() and not text[chars].isspace()
    return len(head.split()) - (1 if cut else 0)


@dataclass
class ServedPrefixCache:
    """The cache as the simulated server uses it: in the sim's tokens, with vLLM's counters."""

    cache: PrefixCache
    queries: int = 0  # requests looked up (taken while the cache is on)
    hits: int = 0  # of those, requests with part of their prompt cached
    prompt_tokens: int = 0  # their prompt tokens, all told
    cached_tokens: int = 0  # of those, the tokens found cached

    @classmethod
    def of(cls, *, capacity_blocks: int) -> ServedPrefixCache:
        return cls(PrefixCache(capacity_blocks=capacity_blocks))

    def cached(self, text: str, *, prompt_tokens: int) -> int:
        """Prompt tokens of `text` whose prefill the cache saves. At least one token is always
        computed, as in vLLM: the last one yields the first output token."""
        found = words_within(text, self.cache.lookup(text))
        return max(0, min(found, prompt_tokens - 1))

    def took(self, text: str, *, prompt_tokens: int, cached_tokens: int) -> None:
        """The server took the request: its blocks are cached now, and the counters count it."""
        if self.cache.capacity_blocks == 0:
            return  # like vLLM without prefix caching: nothing queried, nothing counted
        self.cache.insert(text)
        self.queries += 1
        self.hits += 1 if cached_tokens > 0 else 0
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def stats(self) -> dict[str, dict[str, int]]:
        """`prefix_cache` and its counters for `GET /sim/stats`; nothing until the cache holds
        a block, so a run of short prompts (or one with the cache off) reports what it did."""
        if len(self.cache) == 0:
            return {}
        counts = {
            "queries": self.queries,
            "hits": self.hits,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
        }
        return {"prefix_cache": counts}

    def metrics(self, labels: str) -> str:
        """vLLM's two prefix-cache counters in the Prometheus text format, `_total` suffixed as
        prometheus_client exposes a counter."""
        values = {
            "prefix_cache_queries": self.prompt_tokens,
            "prefix_cache_hits": self.cached_tokens,
        }
        return "".join(
            f"# HELP vllm:{name}_total {_COUNTERS[name]}\n"
            f"# TYPE vllm:{name}_total counter\n"
            f"vllm:{name}_total{labels} {float(value)}\n"
            for name, value in values.items()
        )
