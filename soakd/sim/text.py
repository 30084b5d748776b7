"""Token counting and pseudo-text generation for the simulated inference server.

Token counting (the contract the client-side prompt generator is calibrated against)
------------------------------------------------------------------------------------
:func:`count_tokens` counts **one token per run of word characters and one token per
punctuation/symbol character**; whitespace is free. In regex terms it is
``len(re.findall(r"\\w+|[^\\w\\s]", text))`` with Python's Unicode ``\\w``::

    count_tokens("Hello, world!")          == 4   # Hello , world !
    count_tokens("def f(x): return x+1")   == 10  # def f ( x ) : return x + 1

:func:`count_chat_tokens` applies the usual chat-template overhead on top (the formula
OpenAI documents for its own models): ``3`` tokens per message, plus the tokens of its
text content, plus ``1`` more when the message has a ``name``, plus ``3`` for priming the
assistant reply. A single user message of *k* tokens therefore counts ``k + 6``.

Output text
-----------
Every output token is a short word followed by a space (or, for code, a short code
fragment), taken from a fixed corpus generated once at import time from a constant seed.
A request's output is a slice of that corpus starting at an offset: derived from the
prompt (and the request ``seed``) when the output must be deterministic, drawn from the
server RNG otherwise. Prose reads as pseudo-English sentences without repetition loops;
prompts that look like code get pseudo-Python.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "CODE",
    "GARBLED",
    "PROSE",
    "Corpus",
    "chat_prompt_text",
    "count_chat_tokens",
    "count_tokens",
    "looks_like_code",
    "output_offset",
]

TOKEN_RE = re.compile(r"\w+|[^\w\s]")

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3


def count_tokens(text: str) -> int:
    """Tokens in *text*: one per run of word characters, one per other non-space character."""
    if not text:
        return 0
    return len(TOKEN_RE.findall(text))


def message_text(content: Any) -> str:
    """The text of a chat message ``content``: a string, or the ``text`` parts of a list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "\n".join(parts)
    raise TypeError("message content must be a string, a list of content parts or null")


def count_chat_tokens(messages: Sequence[dict[str, Any]]) -> int:
    """Prompt tokens of a chat request: 3 per message + content tokens (+1 per name) + 3."""
    total = REPLY_PRIMING_TOKENS
    for message in messages:
        total += TOKENS_PER_MESSAGE + count_tokens(message_text(message.get("content")))
        if message.get("name"):
            total += TOKENS_PER_NAME
    return total


def chat_prompt_text(messages: Sequence[dict[str, Any]]) -> str:
    """A canonical flat text of a conversation (used to seed deterministic outputs)."""
    return "\n".join(f"{m.get('role', '')}: {message_text(m.get('content'))}" for m in messages)


_CODE_HINT = re.compile(
    r"```|\bdef \w+\(|\bclass \w+|\bfunction\b|\breturn\b|#include|\bimport \w+|=>|;\s*$|\{\s*$",
    re.MULTILINE,
)


def looks_like_code(text: str) -> bool:
    """Whether a prompt looks like source code (answered with the code corpus)."""
    return bool(_CODE_HINT.search(text[-4000:]))


def output_offset(prompt: str, seed: int | None, size: int, variant: int = 0) -> int:
    """The deterministic corpus offset for a prompt (and an optional request seed).

    ``variant`` > 0 gives another, equally deterministic offset for the same prompt and seed
    (the simulator's ``output_change_at`` fault: the outputs changed, e.g. new weights)."""
    key = prompt if seed is None else f"{seed}\x00{prompt}"
    if variant:
        key = f"{variant}\x01{key}"
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % size


class Corpus:
    """A fixed cyclic sequence of output tokens, with their JSON encodings pre-built."""

    __slots__ = ("_doubled", "_doubled_json", "name", "size", "tokens", "tokens_json")

    def __init__(self, name: str, tokens: Iterable[str]) -> None:
        self.name = name
        self.tokens: list[str] = list(tokens)
        if not self.tokens:
            raise ValueError("a corpus needs at least one token")
        self.size = len(self.tokens)
        self.tokens_json: list[bytes] = [json.dumps(t).encode() for t in self.tokens]
        self._doubled = self.tokens + self.tokens
        self._doubled_json = self.tokens_json + self.tokens_json

    def take(self, offset: int, n: int) -> tuple[list[str], list[bytes]]:
        """*n* tokens from *offset* (wrapping around): ``(texts, json_encoded)``."""
        offset %= self.size
        if n <= self.size:
            return self._doubled[offset : offset + n], self._doubled_json[offset : offset + n]
        idx = [(offset + i) % self.size for i in range(n)]
        return [self.tokens[i] for i in idx], [self.tokens_json[i] for i in idx]


# --------------------------------------------------------------------------- prose

_NOUNS = (
    "system river garden engine signal window model teacher city market number pattern "
    "letter forest bridge station memory question answer process kernel harbor report "
    "summer mountain village network student journey library record voice season "
    "machine field planet picture office budget island museum channel theory"
).split()
_VERBS = (
    "follows measures builds carries changes shows keeps moves holds finds reaches "
    "explains supports opens covers turns watches gathers prepares describes "
    "improves connects records guides"
).split()
_ADJS = (
    "quiet bright careful steady simple early modern distant green small useful "
    "narrow gentle clear heavy recent warm patient common rapid honest open"
).split()
_ADVS = "slowly often quietly clearly rarely gently carefully again soon together".split()
_PREPS = "near across under beyond inside behind above along through around".split()
_DETS = "the a every each one this another".split()
_CONNECT = "and but while because so although".split()


def _sentence(rng: random.Random) -> list[str]:
    def pick(words: Sequence[str]) -> str:
        return words[rng.randrange(len(words))]

    form = rng.randrange(4)
    if form == 0:
        words = [
            pick(_DETS),
            pick(_ADJS),
            pick(_NOUNS),
            pick(_VERBS),
            "the",
            pick(_NOUNS),
            pick(_PREPS),
            "the",
            pick(_ADJS),
            pick(_NOUNS),
        ]
    elif form == 1:
        words = [
            pick(_DETS),
            pick(_NOUNS),
            pick(_VERBS),
            pick(_ADVS) + ",",
            pick(_CONNECT),
            "the",
            pick(_NOUNS),
            pick(_VERBS),
            "a",
            pick(_ADJS),
            pick(_NOUNS),
        ]
    elif form == 2:
        words = [
            pick(_PREPS).capitalize(),
            "the",
            pick(_ADJS),
            pick(_NOUNS),
            "the",
            pick(_NOUNS),
            pick(_VERBS),
            "its",
            pick(_NOUNS),
        ]
    else:
        words = ["The", pick(_NOUNS), "of", "the", pick(_NOUNS), pick(_VERBS), pick(_ADVS)]
    words[0] = words[0][0].upper() + words[0][1:]
    words[-1] += "."
    return [w + " " for w in words]


def _build_prose(size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < size:
        out.extend(_sentence(rng))
    return out[:size]


# --------------------------------------------------------------------------- code

_IDENTS = (
    "value items result count total config path data index buffer offset name state "
    "queue record entry limit window batch"
).split()
_FUNCS = (
    "load_config parse_line read_block update_state compute_total merge_items "
    "flush_buffer check_limit next_window encode_record"
).split()


def _code_line(rng: random.Random) -> list[str]:
    def pick(words: Sequence[str]) -> str:
        return words[rng.randrange(len(words))]

    form = rng.randrange(6)
    if form == 0:
        return ["\ndef ", pick(_FUNCS) + "(", pick(_IDENTS) + "):\n"]
    if form == 1:
        return ["    " + pick(_IDENTS) + " ", "= ", pick(_FUNCS) + "(", pick(_IDENTS) + ")\n"]
    if form == 2:
        return [
            "    if ",
            pick(_IDENTS) + " ",
            "is ",
            "None:\n",
            "        return ",
            pick(_IDENTS) + "\n",
        ]
    if form == 3:
        return [
            "    for ",
            "item ",
            "in ",
            pick(_IDENTS) + ":\n",
            "        " + pick(_IDENTS) + " ",
            "+= ",
            "item\n",
        ]
    if form == 4:
        return ["    # ", pick(_VERBS) + " ", "the ", pick(_NOUNS) + "\n"]
    return ["    return ", pick(_IDENTS) + "\n"]


def _build_code(size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < size:
        out.extend(_code_line(rng))
    return out[:size]


CORPUS_SIZE = 8192
PROSE = Corpus("prose", _build_prose(CORPUS_SIZE, 0x50AD))
CODE = Corpus("code", _build_code(CORPUS_SIZE, 0xC0DE))
# What a broken model emits: replacement characters and a degenerate repetition loop.
GARBLED = Corpus("garbled", ["\ufffd", "the ", "the ", "\ufffd\ufffd ", "the ", "the "])
