"""The simulator's prefix cache: vLLM's automatic prefix caching, in miniature.

A prompt is cut into full blocks of ``kv_block_size`` tokens (the simulator's tokens: runs of word
characters and single other characters, ``soakd.sim.text``); each block is named by a hash chained
over every block before it (vLLM hashes a block with its parent's hash), so a block hits only where
the whole prompt up to its end was seen before. A lookup counts the prompt's tokens as queried and
the tokens of its leading cached blocks as hits (vLLM's ``prefix_cache_queries`` /
``prefix_cache_hits``, in tokens; as in vLLM the last token is always computed, so a prompt never hits
in full), then inserts the prompt's blocks as the most recently used. The cache holds ``capacity``
blocks and evicts the least recently used beyond it. A cached prefix is not prefilled again: the
request's prefill costs only its uncached tokens (``SimModel.prefill_seconds``).
"""

from __future__ import annotations

from collections import OrderedDict

from soakd.sim.text import TOKEN_RE

__all__ = ["PrefixCache"]


class PrefixCache:
    """An LRU set of chained block hashes, with vLLM's query and hit counters (tokens)."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def resize(self, capacity: int) -> None:
        """A new capacity in blocks; the least recently used beyond it are evicted at once."""
        self.capacity = max(0, capacity)
        self._evict()

    def _evict(self) -> None:
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def lookup(self, text: str, prompt_tokens: int) -> int:
        """Tokens of ``text``'s leading blocks already cached; counts ``prompt_tokens`` queried and the
        cached tokens hit, and caches the prompt's full blocks."""
        self.queries += prompt_tokens
        if self.capacity <= 0 or prompt_tokens <= 1:
            return 0
        tokens = TOKEN_RE.findall(text)
        size = self.block_size
        full = min(len(tokens), prompt_tokens) // size
        parent = 0
        cached = 0
        matching = True
        blocks = self._blocks
        for i in range(full):
            parent = hash((parent, *tokens[i * size:(i + 1) * size]))
            if matching and parent in blocks:
                blocks.move_to_end(parent)
                cached += size
            else:
                matching = False
                blocks[parent] = None
        self._evict()
        cached = min(cached, prompt_tokens - 1)
        self.hits += cached
        return cached
