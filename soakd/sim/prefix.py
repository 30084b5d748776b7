"""The simulator's prefix cache: vLLM's automatic prefix caching, in miniature.

A prompt is cut into full blocks of ``kv_block_size`` tokens (the simulator's tokens: runs of word
characters and single other characters, ``soakd.sim.text``); each block is named by a hash chained
over every block before it (vLLM hashes a block with its parent's hash), so a block hits only where
the whole prompt up to its end was seen before. A lookup counts the prompt's tokens as queried and
the tokens of its leading cached blocks as hits (vLLM's ``prefix_cache_queries`` /
``prefix_cache_hits``, in tokens; as in vLLM the last token is always computed, so a prompt seen before
hits its first ``(n - 1) // block_size`` blocks, whole blocks only), then marks the prompt's blocks as
the most recently used, its first block last (vLLM frees a request's blocks tail first, so that a
chain is evicted from its leaf: evicting the root first would strand every block after it). The cache
holds ``capacity`` blocks and evicts the least recently used beyond it. A cached prefix is not
prefilled again: the request's prefill costs only its uncached tokens (``SimModel.prefill_seconds``).
TensorRT-LLM counts blocks, not tokens (``query_blocks``: each prompt's blocks, its last partial one
included). The prompt is tokenised with a regular expression on every request: a few microseconds per
thousand tokens, small beside the simulated prefill.
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
        self.queries = 0  # tokens
        self.hits = 0  # tokens, whole blocks
        self.query_blocks = 0  # ceil(prompt tokens / block size), summed

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
        size = self.block_size
        self.query_blocks += -(-max(0, prompt_tokens) // size)
        if self.capacity <= 0 or prompt_tokens <= 1:
            return 0
        tokens = TOKEN_RE.findall(text)
        full = min(len(tokens), prompt_tokens) // size
        usable = (prompt_tokens - 1) // size  # the last token is computed: whole blocks before it
        parent = 0
        cached = 0
        matching = True
        blocks = self._blocks
        chain = []
        for i in range(full):
            parent = hash((parent, *tokens[i * size:(i + 1) * size]))
            chain.append(parent)
            if matching and parent in blocks and i < usable:
                cached += size
            else:
                matching = False
        for h in reversed(chain):  # the leaf least recent, the root most recent: evicted leaf first
            blocks[h] = None
            blocks.move_to_end(h)
        self._evict()
        self.hits += cached
        return cached
