"""Trace replay: a scenario whose requests, lengths and arrival times come from a file of the user's.

Three formats, read whole at start (a malformed line fails the start with its line and field):

* ``mooncake`` — Mooncake / AIPerf JSONL: ``timestamp`` (ms), ``input_length``, ``output_length`` and
  optionally ``hash_ids``: the prompt is built from blocks of ``block_size`` tokens, one per hash id, so
  requests whose leading ``hash_ids`` agree share a byte-identical prefix (what a prefix cache sees).
* ``burstgpt`` — BurstGPT CSV: ``Timestamp`` (s), ``Request tokens``, ``Response tokens`` (the model and
  log-type columns are read past; rows whose response is 0 tokens, failed requests in the log, are skipped).
* ``conversations`` — JSONL in the ShareGPT shape (``{"conversations": [{"from", "value"}]}``) or OpenAI's
  (``{"messages": [{"role", "content"}]}``), optionally a ``timestamp`` (ms) per line: each conversation is
  replayed turn by turn, every user turn sent with the conversation's history as the file records it, its
  ``max_tokens`` the length of the recorded reply.

Arrivals are the trace's timestamps (``speedup``: 2 replays it twice as fast), or its shape at a given
mean rate (``load.rate``), restarted at every analysis window and looped within it, so that every window
sees the same stretch of the trace (a window is comparable only if its load is). Text that soakd makes up
(prompt blocks, prompts without hash ids) is salted with the pass through the trace: within a pass blocks
repeat as the trace says; a later pass does not find an earlier one's blocks in the cache.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from soakd.config import ConfigError
from soakd.core.timeline import Timeline
from soakd.workload.corpus import WORDS, Corpus, estimate_tokens

__all__ = ["FORMATS", "Trace", "TraceArrival", "TraceEntry", "TracePrompts", "load_trace", "replay_text",
           "sniff_format", "stretch", "time_scale", "trace_arrivals"]

FORMATS = ("mooncake", "burstgpt", "conversations")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
          "developer": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
          "model": "assistant"}
MIN_PERIOD = 1e-3  # seconds: a pass is never replayed faster than this (a huge speedup or rate)


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One request of the trace (a whole conversation, for ``conversations``)."""

    offset: float | None  # seconds after the trace's first entry; None: the file gives no time
    input_length: int = 0  # tokens of the prompt (mooncake, burstgpt)
    output_length: int = 0  # tokens of the answer: max_tokens
    hash_ids: tuple[int, ...] = ()
    messages: tuple[dict[str, str], ...] = ()  # conversations: every message, in order
    line: int = 0

    def turns(self) -> list[tuple[list[dict[str, str]], int | None]]:
        """A conversation's requests: for each user message, the history up to it and the recorded
        reply's length in tokens (None: no reply recorded)."""
        out = []
        msgs = list(self.messages)
        for i, m in enumerate(msgs):
            if m["role"] != "user":
                continue
            reply = msgs[i + 1]["content"] if i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant" else None
            out.append((msgs[:i + 1], max(1, estimate_tokens(reply)) if reply is not None else None))
        return out


@dataclass(frozen=True)
class Trace:
    path: Path
    format: str
    entries: tuple[TraceEntry, ...]
    skipped: int = 0  # rows read past (burstgpt: 0 tokens, a failed request; conversations: no user turn)
    timed: bool = True

    @property
    def span(self) -> float:
        """Seconds from the first entry to the last (unscaled)."""
        return (self.entries[-1].offset or 0.0) if self.timed and self.entries else 0.0

    @property
    def period(self) -> float:
        """One pass through the trace, unscaled: its span plus one mean gap (the loop's seam is a typical
        gap, not zero); 1 s for a trace of one entry."""
        n = len(self.entries)
        if n < 2 or self.span <= 0:
            return max(self.span, 1.0)
        return self.span * n / (n - 1)

    @property
    def requests(self) -> int:
        """Requests of one pass (a conversation sends one per user turn)."""
        if self.format == "conversations":
            return sum(len(e.turns()) for e in self.entries)
        return len(self.entries)


def sniff_format(path: Path) -> str:
    """The format from the file: ``.csv`` is BurstGPT; a JSON line with ``input_length`` Mooncake, with
    ``conversations``, ``messages`` or ``conversation`` a conversation file."""
    if path.suffix.lower() == ".csv":
        return "burstgpt"
    try:
        with path.open(encoding="utf-8-sig") as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    if isinstance(obj, dict) and "input_length" in obj:
                        return "mooncake"
                    if isinstance(obj, dict) and ({"conversations", "messages", "conversation"} & set(obj)):
                        return "conversations"
                    break
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    raise ConfigError([f"trace {path}: cannot tell its format; set source.format to one of {', '.join(FORMATS)}"])


def load_trace(path: Path, fmt: str | None = None) -> Trace:
    """Read a trace file (cached per path, format, size and mtime: validation at start and the replay read
    it once). Raises ConfigError naming the line and the field."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError([f"trace {path}: cannot read it: {exc}"]) from None
    return _load(path, fmt or sniff_format(path), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _load(path: Path, fmt: str, _size: int, _mtime: int) -> Trace:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (spreadsheet exports) is not a column
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"trace {path}: cannot read it: {exc}"]) from None
    if fmt == "burstgpt":
        rows, skipped = _burstgpt(path, text)
    elif fmt == "mooncake":
        rows, skipped = _mooncake(path, text), 0
    elif fmt == "conversations":
        rows, skipped = _conversations(path, text)
    else:
        raise ConfigError([f"trace {path}: unknown format {fmt!r}; expected one of {', '.join(FORMATS)}"])
    if not rows:
        raise ConfigError([f"trace {path}: no requests in it"])
    timed = all(r.offset is not None for r in rows)
    if not timed and any(r.offset is not None for r in rows):
        first = next(r for r in rows if r.offset is None)
        raise ConfigError([f"trace {path} line {first.line}: field 'timestamp' missing (other lines have one: "
                           "give every line a timestamp, or none)"])
    if timed:
        rows.sort(key=lambda r: r.offset or 0.0)  # stable: equal timestamps keep the file's order
        t0 = rows[0].offset or 0.0
        rows = [TraceEntry((r.offset or 0.0) - t0, r.input_length, r.output_length, r.hash_ids, r.messages, r.line)
                for r in rows]
    return Trace(path, fmt, tuple(rows), skipped, timed)


def _where(path: Path, line: int, name: str) -> str:
    return f"trace {path} line {line}: field {name!r}"


def _positive_int(path: Path, line: int, obj: dict[str, Any], name: str) -> int:
    v = obj.get(name)
    if name not in obj:
        raise ConfigError([f"{_where(path, line, name)} missing"])
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v != int(v) or v < 1:
        raise ConfigError([f"{_where(path, line, name)}: expected a positive whole number of tokens, got {v!r}"])
    return int(v)


def _timestamp(path: Path, line: int, v: Any, name: str, scale: float) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ConfigError([f"{_where(path, line, name)}: expected a time >= 0, got {v!r}"])
    return float(v) * scale


def json_lines(where: str, text: str) -> Iterator[tuple[int, Any]]:
    """The JSON value of every non-blank line of a JSONL file, with its line number; a line that is not JSON
    stops the start with ``<where> line <n>: not valid JSON`` (a trace here, a dataset in
    ``soakd.workload.scenarios``)."""
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            yield lineno, json.loads(raw)
        except ValueError as exc:
            raise ConfigError([f"{where} line {lineno}: not valid JSON: {exc}"]) from None


def _json_lines(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    for lineno, obj in json_lines(f"trace {path}", text):
        if not isinstance(obj, dict):
            raise ConfigError([f"trace {path} line {lineno}: expected a JSON object, got {type(obj).__name__}"])
        yield lineno, obj


def _mooncake(path: Path, text: str) -> list[TraceEntry]:
    out = []
    for lineno, obj in _json_lines(path, text):
        if "timestamp" not in obj:
            raise ConfigError([f"{_where(path, lineno, 'timestamp')} missing (milliseconds)"])
        ts = _timestamp(path, lineno, obj["timestamp"], "timestamp", 1e-3)
        n_in = _positive_int(path, lineno, obj, "input_length")
        n_out = _positive_int(path, lineno, obj, "output_length")
        hashes = obj.get("hash_ids", [])
        if not isinstance(hashes, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hashes):
            raise ConfigError([f"{_where(path, lineno, 'hash_ids')}: expected a list of integers"])
        out.append(TraceEntry(ts, n_in, n_out, tuple(hashes), line=lineno))
    return out


_BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")


def _burstgpt(path: Path, text: str) -> tuple[list[TraceEntry], int]:
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in _BURSTGPT_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ConfigError([f"trace {path} line 1: the header lacks column(s) {', '.join(map(repr, missing))} "
                           f"(BurstGPT: Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type)"])
    out = []
    skipped = 0
    for row in reader:
        lineno = reader.line_num
        vals: dict[str, float] = {}
        for col in _BURSTGPT_COLUMNS:
            raw = (row.get(col) or "").strip()
            try:
                vals[col] = float(raw)
            except ValueError:
                raise ConfigError([f"{_where(path, lineno, col)}: expected a number, got {raw!r}"]) from None
        ts = _timestamp(path, lineno, vals["Timestamp"], "Timestamp", 1.0)
        n_in, n_out = vals["Request tokens"], vals["Response tokens"]
        for col, v in (("Request tokens", n_in), ("Response tokens", n_out)):
            if not math.isfinite(v) or v < 0 or v != int(v):
                raise ConfigError([f"{_where(path, lineno, col)}: expected a whole number >= 0, got {v!r}"])
        if n_out == 0 or n_in == 0:
            skipped += 1  # a failed request in the log: nothing was generated
            continue
        out.append(TraceEntry(ts, int(n_in), int(n_out), line=lineno))
    return out, skipped


def _content(v: Any) -> str | None:
    """A message's text: a string, or OpenAI's list of parts (their text parts, joined)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) for p in v):
        return "".join(str(p.get("text", "")) for p in v if p.get("type", "text") == "text")
    return None


def _conversations(path: Path, text: str) -> tuple[list[TraceEntry], int]:
    """ShareGPT (``conversations`` of from/value), OpenAI (``messages`` of role/content) and LMSYS-Chat /
    WildChat (``conversation`` of role/content) lines. A line with nothing to send (an empty conversation,
    no user turn) is skipped and counted, as real dumps hold many; one that is not a conversation is an
    error."""
    out = []
    skipped = 0
    for lineno, obj in _json_lines(path, text):
        ts = None
        if "timestamp" in obj:
            ts = _timestamp(path, lineno, obj["timestamp"], "timestamp", 1e-3)
        name = next((k for k in ("conversations", "messages", "conversation") if k in obj), None)
        if name is None:
            raise ConfigError([f"trace {path} line {lineno}: field 'conversations' (or 'messages') missing"])
        turns = obj[name]
        key_role, key_text = ("from", "value") if name == "conversations" else ("role", "content")
        if not isinstance(turns, list):
            raise ConfigError([f"{_where(path, lineno, name)}: expected a list of messages"])
        msgs = []
        for i, t in enumerate(turns):
            role = _ROLES.get(str(t.get(key_role, "")).lower()) if isinstance(t, dict) else None
            content = _content(t.get(key_text)) if isinstance(t, dict) else None
            if not isinstance(t, dict) or content is None:
                raise ConfigError([f"{_where(path, lineno, f'{name}[{i}]')}: expected "
                                   f"{{{key_role!r}: user|assistant|system, {key_text!r}: text}}, got {t!r:.80}"])
            if role is not None:  # tool results and other roles are left out of the replayed history
                msgs.append({"role": role, "content": content})
        if not any(m["role"] == "user" for m in msgs):
            skipped += 1
            continue
        out.append(TraceEntry(ts, messages=tuple(msgs), line=lineno))
    return out, skipped


# ---- arrivals ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceArrival:
    t: float  # monotonic send time
    index: int  # the entry
    pass_no: int  # which pass through the trace (a window restarts it; a short trace loops within one)


def _requests_of(entry: TraceEntry) -> int:
    return len(entry.turns()) if entry.messages else 1


def time_scale(trace: Trace, speedup: float = 1.0, rate: float | None = None, window: float | None = None) -> float:
    """Seconds of replay per second of trace: ``1 / speedup``; or, given a mean rate of requests per second,
    the scale at which a window carries that rate: the whole pass at that rate when a window holds at
    least one, else the stretch of the trace's first ``rate * window`` requests stretched over the window
    (each window replays only its first stretch)."""
    if rate is None:
        return 1.0 / speedup
    per_window = rate * window if window is not None else math.inf
    if per_window >= trace.requests or not trace.timed:
        return trace.requests / (trace.period * rate)
    seen = 0
    for e in trace.entries:
        if seen >= per_window and (e.offset or 0.0) > 0:
            return float(window) / (e.offset or 1.0)  # type: ignore[arg-type]
        seen += _requests_of(e)
    return trace.requests / (trace.period * rate)


def stretch(trace: Trace, scale: float, window: float) -> tuple[float, int]:
    """What one window replays of the trace: seconds of trace and requests (the whole pass, or its start)."""
    span = window / scale
    if trace.period <= span:
        return trace.period, trace.requests
    return span, sum(_requests_of(e) for e in trace.entries if (e.offset or 0.0) < span)


def replay_text(scenarios: dict[str, Any], rate: float | None, window: float) -> str:
    """What the mix's trace sends per window, for the log line that starts the load."""
    sc = next(s for s in scenarios.values() if s.source_type == "trace")
    tr = load_trace(sc.source_path, sc.source_format)
    skipped = f", {tr.skipped} lines skipped (nothing to send)" if tr.skipped else ""
    scale = time_scale(tr, sc.speedup, rate, window)
    secs, n = stretch(tr, scale, window)
    if secs >= tr.period:
        what = f"the whole trace ({n} requests in {tr.period:.1f} s of trace) replayed in {tr.period * scale:.1f} s"
    else:
        what = (f"only its first {secs:.1f} s of {tr.period:.1f} s ({n} of {tr.requests} requests) fit a window of "
                f"{window:g} s")
    return f"{sc.source_path} ({tr.format}): {what}{skipped}; restarted every window"


def trace_arrivals(trace: Trace, tl: Timeline, scale: float) -> Iterator[TraceArrival]:
    """Send times over the run: the warm-up, then every window, each from the trace's start, looped while
    the stretch lasts; ends at the timeline's end. A pass's number is unique in the run (the window's
    absolute index and the loop within it): text salted with it never repeats across windows or segments."""
    period = max(trace.period * scale, MIN_PERIOD)
    offsets = [(e.offset or 0.0) * scale for e in trace.entries]
    segments: list[tuple[int, float, float]] = []
    if tl.first_window_start > tl.start:
        segments.append((-1, tl.start, min(tl.first_window_start, tl.end)))
    k = tl.first_index
    while True:
        a, b = tl.window_bounds(k)
        if a >= tl.end:
            break
        segments.append((k, a, b))
        k += 1
    for w, a, b in segments:
        base = a
        loop = 0
        while base < b:
            pass_no = (w + 1) * 1_000_000 + loop
            for i, off in enumerate(offsets):
                t = base + off
                if t >= b:
                    break
                yield TraceArrival(t, i, pass_no)
            loop += 1
            base = a + loop * period


# ---- prompts -------------------------------------------------------------------------------------


@dataclass
class TracePrompts:
    """The text of a trace's requests: deterministic from the seed and the pass."""

    corpus: Corpus
    seed: int
    block_size: int = 512
    _blocks: dict[tuple[int, int], list[str]] = field(default_factory=dict)

    def _block(self, pass_no: int, h: int) -> list[str]:
        key = (pass_no, h)
        words = self._blocks.get(key)
        if words is None:
            if len(self._blocks) > 8192:
                self._blocks.clear()
            # words of its own (not a slice of the shared corpus: two ids never draw the same block)
            words = random.Random(f"trace-block-{self.seed}-{pass_no}-{h}").choices(WORDS, k=self.block_size)
            self._blocks[key] = words
        return words

    def history(self, messages: list[dict[str, str]], pass_no: int) -> list[dict[str, str]]:
        """A recorded conversation as sent in pass ``pass_no``: its first message tagged with the pass, so that
        no window finds an earlier pass's conversation in the prefix cache (later turns still share their own
        conversation's prefix, as they would in the traced service)."""
        first = {**messages[0], "content": f"[{pass_no}] {messages[0]['content']}"}
        return [first, *messages[1:]]

    def text(self, entry: TraceEntry, index: int, pass_no: int, overhead: int = 0) -> str:
        """``input_length - overhead`` words: the hash ids' blocks in order (the last one cut to fit), and
        beyond them (a trace with fewer hash ids than its length needs) words unique to the request."""
        n = max(1, entry.input_length - overhead)
        words: list[str] = []
        for h in entry.hash_ids:
            if len(words) >= n:
                break
            words.extend(self._block(pass_no, h))
        if len(words) < n:
            rng = random.Random(f"trace-request-{self.seed}-{pass_no}-{index}")
            words.extend(self.corpus.text(rng, n - len(words)).split(" "))
        return " ".join(words[:n])
