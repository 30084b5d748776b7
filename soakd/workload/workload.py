"""Turns the mix into units of work: one request, a burst of N, or the next turn of a conversation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from soakd.workload.corpus import Corpus, estimate_tokens
from soakd.workload.mix import StratifiedMix
from soakd.workload.scenarios import CHAT_MESSAGE_OVERHEAD, CHAT_TEMPLATE_OVERHEAD, PromptSource, Scenario
from soakd.workload.trace import Trace, TraceArrival, TracePrompts, load_trace


@dataclass
class Conversation:
    scenario: Scenario
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0
    busy: bool = False
    content_tokens: int = 0  # estimated tokens of every message's content so far


@dataclass
class PlannedRequest:
    scenario: Scenario
    body: dict[str, Any]
    expected_prompt_tokens: int
    max_tokens: int
    conversation: Conversation | None = None
    after_previous: bool = False  # sent when the unit's previous request succeeded (a replayed conversation)


class Workload:
    """Builds request bodies. Deterministic for a given seed and sequence of calls."""

    def __init__(self, scenarios: dict[str, Scenario], weights: dict[str, float], model: str, seed: int = 0,
                 corpus: Corpus | None = None, share: tuple[int, int] = (0, 1)) -> None:
        """``share``: (k, N), load worker k of N (``load.workers``): its own draws (prompts, lengths, the mix's
        order), the run's shared text (corpus, shared prefixes, a trace's blocks), trace entries k, k+N, ... in
        the closed loop and a dataset from its k-th N-th; (0, 1), a single worker, is the same as before."""
        self.scenarios = scenarios
        self.model = model
        self.share = share
        k = share[0]
        # weights are shares of requests; a batch_burst pick releases burst_size requests at once
        self.mix = StratifiedMix(
            {n: w / max(1, scenarios[n].burst_size) for n, w in weights.items() if n in scenarios},
            seed if not k else f"{seed}-w{k}",
        )
        request_weight = sum(w for n, w in weights.items() if n in scenarios and w > 0)
        self.requests_per_unit = request_weight / self.mix.total
        """Mean requests per unit (a burst is one unit): the open loop's unit rate is rate / this."""
        corpus = corpus or Corpus(seed)
        self.sources = {name: PromptSource(sc, corpus, seed, share) for name, sc in scenarios.items()}
        self._idle_conversations: dict[str, list[Conversation]] = {n: [] for n in scenarios}
        self.trace: Trace | None = None
        self.trace_scenario: Scenario | None = None
        for sc in scenarios.values():
            if sc.source_type == "trace" and sc.source_path is not None and weights.get(sc.name, 0) > 0:
                self.trace = load_trace(sc.source_path, sc.source_format)
                self.trace_scenario = sc
                self._prompts = TracePrompts(corpus, seed, sc.block_size)
                self.requests_per_unit = self.trace.requests / len(self.trace.entries)
        self._trace_window: int | None = None
        self._trace_next = 0
        self._trace_loop = 0

    def next_unit(self, window: int = 0, arrival: TraceArrival | None = None) -> list[PlannedRequest]:
        """The next unit of the mix; a trace's: the entry ``arrival`` names, or (closed loop, a trace without
        timestamps) the next one in the trace's order, which every window restarts."""
        if self.trace is not None:
            if arrival is None:
                arrival = self._next_in_order(window)
            return self._trace_unit(arrival)
        name = self.mix.next(window)
        sc = self.scenarios[name]
        if sc.base == "batch_burst":
            return [self._single(sc) for _ in range(sc.burst_size)]
        if sc.base == "multi_turn" or sc.turns > 1:
            return [self._turn(sc)]
        return [self._single(sc)]

    # ---- trace replay
    def _next_in_order(self, window: int) -> TraceArrival:
        assert self.trace is not None
        n = len(self.trace.entries)
        k, step = self.share
        if window != self._trace_window:
            self._trace_window, self._trace_next, self._trace_loop = window, k % n, 0
        elif self._trace_next >= n:
            self._trace_next, self._trace_loop = k % n, self._trace_loop + 1
        i = self._trace_next
        self._trace_next += step
        return TraceArrival(0.0, i, (window + 1) * 1_000_000 + self._trace_loop)  # as trace_arrivals numbers passes

    def _trace_unit(self, arrival: TraceArrival) -> list[PlannedRequest]:
        assert self.trace is not None and self.trace_scenario is not None
        sc = self.trace_scenario
        entry = self.trace.entries[arrival.index]
        if entry.messages:
            out = []
            for k, (messages, reply_tokens) in enumerate(entry.turns()):
                mt = reply_tokens if reply_tokens is not None else self.sources[sc.name].max_tokens()
                out.append(PlannedRequest(sc, self._body(sc, self._prompts.history(messages, arrival.pass_no), mt), 0,
                                          mt, after_previous=k > 0))
            return out
        overhead = CHAT_TEMPLATE_OVERHEAD if sc.endpoint == "chat" else 0
        text = self._prompts.text(entry, arrival.index, arrival.pass_no, overhead)
        body = self._body(sc, [{"role": "user", "content": text}], entry.output_length)
        return [PlannedRequest(sc, body, entry.input_length, entry.output_length)]

    # ---- bodies
    def _body(self, sc: Scenario, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": sc.temperature}
        if sc.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = "\n\n".join(m["content"] for m in messages)
        if sc.stream:
            body["stream"] = True
            if sc.include_usage:
                body["stream_options"] = {"include_usage": True}
        if sc.extra_body:
            body.update(sc.extra_body)
        return body

    def _single(self, sc: Scenario) -> PlannedRequest:
        src = self.sources[sc.name]
        n = src.length()
        mt = src.max_tokens()
        messages = src.messages(n)
        # a dataset prompt has no target length: 0 keeps it out of the prompt-length accuracy
        expected = n + _prefix_tokens(sc, src.prefix_tokens) if src.dataset is None else 0
        return PlannedRequest(sc, self._body(sc, messages, mt), expected, mt)

    def _turn(self, sc: Scenario) -> PlannedRequest:
        src = self.sources[sc.name]
        idle = self._idle_conversations[sc.name]
        conv = idle.pop() if idle else None
        n = src.length()
        if conv is None:
            conv = Conversation(sc, messages=list(src.messages(n)))
            conv.content_tokens = sum(estimate_tokens(m["content"]) for m in conv.messages)  # a shared prefix too
        else:
            text = src.turn_text(n)
            conv.messages = conv.messages + [{"role": "user", "content": text}]
            conv.content_tokens += n
        conv.turn += 1
        conv.busy = True
        mt = src.max_tokens()
        # the whole conversation is the prompt: every message's content plus the template around it
        expected = conv.content_tokens + CHAT_TEMPLATE_OVERHEAD + CHAT_MESSAGE_OVERHEAD * (len(conv.messages) - 1)
        if src.dataset is not None or sc.endpoint != "chat":
            expected = 0 if src.dataset is not None else conv.content_tokens
        return PlannedRequest(sc, self._body(sc, conv.messages, mt), expected, mt, conv)

    def finish_turn(self, planned: PlannedRequest, ok: bool, reply: str) -> None:
        """Called when a conversation turn completed: the reply joins the history, or the
        conversation ends (failed turn, or all turns done)."""
        conv = planned.conversation
        if conv is None:
            return
        conv.busy = False
        if ok and conv.turn < conv.scenario.turns:
            conv.messages = conv.messages + [{"role": "assistant", "content": reply}]
            conv.content_tokens += estimate_tokens(reply)
            self._idle_conversations[conv.scenario.name].append(conv)


def _prefix_tokens(sc: Scenario, tokens: int) -> int:
    """What a shared prefix adds to a prompt: its tokens, and in a chat request the system message's own."""
    return tokens + CHAT_MESSAGE_OVERHEAD if tokens and sc.endpoint == "chat" else tokens
