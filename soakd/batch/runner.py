"""``soakd batch``: send an OpenAI Batch API input file, validate every output, account for
every line, survive restarts.

* **State** lives in the run store (``batches``, ``batch_items``): a batch is identified by its
  input file's sha256; a batch of the same input that did not finish is resumed (``--new-batch``:
  start over). An input is recorded once it is *finished* — answered and valid (``done``), or
  given up (``failed``, with why) — so a restart never re-sends a finished ``custom_id``. Sending is
  at-least-once: an input in flight when soakd died is sent again.
* **Sending**: ``batch.concurrency`` requests in flight, non-streaming, each with
  ``X-Request-Id: soakd-batch-<custom_id>-<n>`` (vLLM and the simulator take it as the request id).
  A body without ``model`` gets the target's (``--model`` or the first of ``/v1/models``).
* **Retries**: HTTP 408, 429 and 5xx, timeouts, connection errors and outputs that fail validation
  are retried with exponential backoff (``batch.backoff`` doubled per try, jitter, at most 30 s)
  up to ``batch.max_tries``; other HTTP errors (400, 404, 422: the input is bad) are given up at
  once — a batch is never stuck on one bad input.
* **Validation** (the soak client's checks, ``target.validation``): chat and completions outputs
  must have choices with text that is not empty, garbled or degenerate; ``finish_reason: length``
  is *truncated* (counted, kept as an answer); embeddings must carry a non-empty vector per input.
* **Output**, written when every input is finished, in input order: the OpenAI batch output file
  (``{id, custom_id, response: {status_code, request_id, body}, error: null}`` per answered
  input) and the error file (``{id, custom_id, response | null, error: {code, message}}`` per
  failed input and bad line). Every ``custom_id`` of the input is in exactly one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import structlog

from soakd.batch.input import BadLine, BatchLine, read_input
from soakd.client.openai import OpenAIClient
from soakd.client.validate import check_output
from soakd.config import SoakConfig
from soakd.soak.target import resolve_model
from soakd.store import RunStore

log = structlog.get_logger("soakd.batch")

RETRY_STATUS = {408, 409, 425, 429}
BACKOFF_CAP = 30.0
FLUSH_EVERY = 0.5  # seconds: finished inputs are committed at least this often (and at the end)


@dataclass
class Item:
    """A finished input as stored: state done | failed."""

    custom_id: str
    line_no: int
    state: str
    tries: int = 0
    status_code: int | None = None
    request_id: str | None = None
    response: Any = None  # the response body (JSON), or its text
    error: dict[str, Any] | None = None
    flags: list[str] = field(default_factory=list)  # truncated

    def row(self) -> tuple[Any, ...]:
        return (self.custom_id, self.line_no, self.state,
                self.tries, self.status_code, self.request_id,
                None if self.response is None else json.dumps(self.response),
                None if self.error is None else json.dumps(self.error), ",".join(self.flags) or None)

    @classmethod
    def from_row(cls, r: tuple[Any, ...]) -> Item:
        return cls(str(r[0]), int(r[1]), str(r[2]), int(r[3]), r[4], r[5], None if r[6] is None else json.loads(r[6]),
                   None if r[7] is None else json.loads(r[7]), [f for f in (r[8] or "").split(",") if f])


@dataclass
class BatchOutcome:
    batch_id: str
    resumed: bool
    finished: bool
    accounting: dict[str, Any]


def _validate(line: BatchLine, obj: Any, rules: Any) -> tuple[str, list[str]]:
    """('' or the reason the output is invalid, flags)."""
    if not isinstance(obj, dict):
        return "malformed_body", []
    if line.url == "/v1/embeddings":
        data = obj.get("data")
        if not isinstance(data, list) or not data or not all(
                isinstance(d, dict) and isinstance(d.get("embedding"), list | str) and d.get("embedding")
                for d in data):
            return "no_embedding", []
        return "", []
    if line.url == "/v1/responses":  # the Responses API: output items, their output_text parts
        output = obj.get("output")
        if not isinstance(output, list):
            return "no_output", []
        text = "".join(part.get("text") or "" for item in output if isinstance(item, dict)
                       for part in (item.get("content") or []) if isinstance(part, dict)
                       and part.get("type") == "output_text")
        flags = ["truncated"] if obj.get("status") == "incomplete" else []
        return check_output(text, rules), flags
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return "no_choices", []
    c0 = choices[0]
    text = (c0.get("message") or {}).get("content") if line.url == "/v1/chat/completions" else c0.get("text")
    flags = ["truncated"] if c0.get("finish_reason") == "length" else []
    reason = check_output(text or "", rules)
    return reason, flags


class BatchRunner:
    def __init__(self, config: SoakConfig, input_path: Path, output: Path, errors: Path, *,
                 new_batch: bool = False, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.input_path = input_path
        self.output = output
        self.errors = errors
        self.new_batch = new_batch
        self.progress = progress
        self.api_key = config.api_key()
        self.client = OpenAIClient(config.target, self.api_key, pool_size=config.batch.concurrency)
        self._stop = asyncio.Event()
        self.stop_reason = ""
        self.counts = {"sent": 0, "retries": 0, "done": 0, "failed": 0}

    def request_stop(self, reason: str = "signal") -> None:
        if not self._stop.is_set():
            log.info("stop_requested", reason=reason)
            self.stop_reason = reason
            self._stop.set()

    async def run(self) -> BatchOutcome:
        cfg = self.config
        good, bad, sha = read_input(self.input_path)
        store = await RunStore.open(cfg.run.state_dir)
        try:
            prior = None if self.new_batch else await store.latest_batch(sha)
            batch_id = prior[0] if prior else "batch_" + uuid.uuid4().hex[:12]
            if prior is None:
                await store.create_batch(batch_id, str(self.input_path), sha, cfg.target.display_url,
                                         {"batch": cfg.batch.model_dump(mode="json"), "target": cfg.target.display_url})
            finished = {it.custom_id: it for it in map(Item.from_row, await store.load_batch_items(batch_id))}
            # bad lines are read again from the input every time: into the error file, never sent
            todo = [ln for ln in good if ln.custom_id not in finished]
            log.info("batch_started", batch=batch_id, resumed=prior is not None, input=str(self.input_path),
                     lines=len(good) + len(bad), bad_lines=len(bad), finished_before=len(good) - len(todo),
                     to_send=len(todo))
            if todo:
                model = None
                if any("model" not in ln.body for ln in todo):
                    model = await resolve_model(self.client, cfg.target, cfg.target.model, has_key=bool(self.api_key),
                                                stop=self._stop, give_up_after=cfg.run.wait_for_target)
                    if model is None:
                        return BatchOutcome(batch_id, prior is not None, False,
                                            self._accounting(good, bad, {}, len(todo), "target_unreachable"))
                await self._send_all(store, batch_id, todo, model, len(good) + len(bad))
            items = {it.custom_id: it for it in map(Item.from_row, await store.load_batch_items(batch_id))}
            left = [ln for ln in good if ln.custom_id not in items]
            acc = self._accounting(good, bad, items, len(left), self.stop_reason)
            if left:
                log.info("batch_stopped", batch=batch_id, unfinished=len(left), reason=self.stop_reason,
                         hint="run the same command again to resume")
                return BatchOutcome(batch_id, prior is not None, False, acc)
            self._write_files(batch_id, good, bad, items)
            await store.finish_batch(batch_id, "finished" if acc["within_budget"] else "failed", acc)
            log.info("batch_finished", batch=batch_id, **{k: v for k, v in acc.items() if k != "failure_reasons"},
                     failure_reasons=acc["failure_reasons"])
            return BatchOutcome(batch_id, prior is not None, True, acc)
        finally:
            await self.client.close()
            await store.close()

    # ---- sending
    async def _send_all(self, store: RunStore, batch_id: str, todo: list[BatchLine], model: str | None,
                        total: int) -> None:
        cfg = self.config.batch
        queue: asyncio.Queue[BatchLine] = asyncio.Queue()
        for ln in todo:
            queue.put_nowait(ln)  # input order
        pending: list[tuple[Any, ...]] = []
        done_before = total - len(todo)
        t0 = time.monotonic()

        async def worker() -> None:
            while not self._stop.is_set():
                try:
                    ln = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                item = await self._one(ln, model)
                if item is not None:
                    pending.append(item.row())
                    self.counts[item.state if item.state in ("done", "failed") else "failed"] += 1

        async def flusher() -> None:
            last = 0.0
            while True:
                await asyncio.sleep(FLUSH_EVERY)
                if pending:
                    rows = pending[:]
                    del pending[:len(rows)]
                    await store.save_batch_items(batch_id, rows)
                now = time.monotonic()
                if now - last >= 2.0:
                    last = now
                    self._show_progress(done_before, total, t0)

        flush = asyncio.create_task(flusher())
        try:
            await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, len(todo)))))
        finally:
            flush.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flush
            if pending:
                await store.save_batch_items(batch_id, pending[:])
            self._show_progress(done_before, total, t0)

    def _show_progress(self, done_before: int, total: int, t0: float) -> None:
        c = self.counts
        finished = done_before + c["done"] + c["failed"]
        rate = (c["done"] + c["failed"]) / max(1e-9, time.monotonic() - t0)
        left = (total - finished) / rate if rate > 0 else None
        line = (f"batch: {finished}/{total} {finished / max(1, total):.0%}"
                + (f" ETA {int(left) // 3600:02d}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}" if left is not None
                   else "")
                + f" | {c['done']} answered, {c['failed']} failed | {c['retries']} retries | {rate:.1f}/s")
        log.info("batch_progress", finished=finished, total=total, answered=c["done"], failed=c["failed"],
                 retries=c["retries"], per_second=round(rate, 2))
        if self.progress is not None:
            self.progress(line)

    async def _one(self, ln: BatchLine, model: str | None) -> Item | None:
        """Send one input until it is finished; None when stopped first."""
        cfg = self.config
        body = {k: v for k, v in ln.body.items() if k not in ("stream", "stream_options")}
        if "model" not in body and model is not None:
            body["model"] = model
        last: Item | None = None
        for attempt in range(1, cfg.batch.max_tries + 1):
            if self._stop.is_set():
                return None
            if attempt > 1:
                self.counts["retries"] += 1
                delay = min(BACKOFF_CAP, cfg.batch.backoff * 2 ** (attempt - 2)) * random.uniform(0.5, 1.0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                if self._stop.is_set():
                    return None
            rid = f"soakd-batch-{quote(ln.custom_id, safe='')[:160]}-{attempt}-{uuid.uuid4().hex[:6]}"
            self.counts["sent"] += 1
            item, retry = await self._attempt(ln, body, rid, attempt)
            last = item
            if not retry:
                return item
        assert last is not None
        return last

    async def _attempt(self, ln: BatchLine, body: dict[str, Any], rid: str, attempt: int) -> tuple[Item, bool]:
        """(the input's item after this try, whether to retry)."""
        def failed(code: str, message: str, status: int | None = None, response: Any = None,
                   request_id: str | None = None) -> Item:
            return Item(ln.custom_id, ln.line_no, "failed", attempt, status, request_id, response,
                        {"code": code, "message": message[:500]})

        try:
            status, server_rid, raw = await self.client.post_json(ln.path, body, headers={"X-Request-Id": rid})
        except TimeoutError:
            return failed("timeout", f"no complete answer within {self.config.target.timeouts.total:g}s"), True
        except (aiohttp.ClientError, OSError) as exc:
            return failed("connection_error", f"{type(exc).__name__}: {exc}"), True
        request_id = server_rid or rid
        try:
            obj: Any = json.loads(raw)
        except ValueError:
            obj = raw[:2000].decode("utf-8", "replace")
        if status != 200:
            msg = obj.get("error", {}).get("message") if isinstance(obj, dict) and isinstance(obj.get("error"), dict) \
                else str(obj)[:300]
            retry = status in RETRY_STATUS or status >= 500
            return failed(f"http_{status}", str(msg), status, obj, request_id), retry
        reason, flags = _validate(ln, obj, self.config.target.validation)
        if reason:
            return failed(reason, f"the output failed validation: {reason}", status, obj, request_id), True
        return Item(ln.custom_id, ln.line_no, "done", attempt, status, request_id, obj, None, flags), False

    # ---- the files and the accounting
    def _write_files(self, batch_id: str, good: list[BatchLine], bad: list[BadLine], items: dict[str, Item]) -> None:
        out_lines, err_lines = [], []
        rows: list[tuple[int, bool, dict[str, Any]]] = []
        for it in items.values():
            rows.append((it.line_no, it.state == "done", {
                "id": f"{batch_id}_req_{it.line_no}", "custom_id": it.custom_id,
                "response": None if it.status_code is None else {
                    "status_code": it.status_code, "request_id": it.request_id, "body": it.response},
                "error": it.error}))
        for b in bad:
            rows.append((b.line_no, False, {"id": f"{batch_id}_req_{b.line_no}", "custom_id": b.custom_id,
                                            "response": None, "error": b.error()}))
        for _n, ok, line in sorted(rows, key=lambda r: r[0]):
            (out_lines if ok else err_lines).append(json.dumps(line, ensure_ascii=False))
        for path, lines in ((self.output, out_lines), (self.errors, err_lines)):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(s + "\n" for s in lines), encoding="utf-8")
            os.replace(tmp, path)  # never a half-written file

    def _accounting(self, good: list[BatchLine], bad: list[BadLine], items: dict[str, Item], unfinished: int,
                    stop_reason: str) -> dict[str, Any]:
        done = [it for it in items.values() if it.state == "done"]
        failed = [it for it in items.values() if it.state == "failed"]
        reasons: dict[str, int] = {}
        for it in failed:
            code = (it.error or {}).get("code", "unknown")
            reasons[code] = reasons.get(code, 0) + 1
        if bad:
            reasons["invalid_input"] = len(bad)
        lines = len(good) + len(bad)
        fail_share = (len(failed) + len(bad)) / lines if lines else 0.0
        return {
            "lines": lines, "valid_lines": len(good), "bad_lines": len(bad), "answered": len(done),
            "failed": len(failed), "unfinished": unfinished,
            "truncated": sum("truncated" in it.flags for it in done),
            "retried_inputs": sum(it.tries > 1 for it in items.values()),
            "requests_sent_now": self.counts["sent"], "failure_share": fail_share,
            "failure_budget": self.config.batch.failure_budget,
            "within_budget": fail_share <= self.config.batch.failure_budget,
            "failure_reasons": dict(sorted(reasons.items())),
            "output": str(self.output), "errors": str(self.errors), "stop_reason": stop_reason or None,
        }


def print_accounting(outcome: BatchOutcome, write: Callable[[str], Any] = sys.stdout.write) -> None:
    a = outcome.accounting
    head = "finished" if outcome.finished else f"stopped ({a['stop_reason'] or 'interrupted'}), resumable"
    write(f"soakd batch {outcome.batch_id}{' (resumed)' if outcome.resumed else ''}: {head}\n"
          f"  lines {a['lines']}: answered {a['answered']} (truncated by length {a['truncated']}), "
          f"failed {a['failed']}, bad lines {a['bad_lines']}, unfinished {a['unfinished']}\n"
          f"  retried inputs {a['retried_inputs']}, requests sent by this run {a['requests_sent_now']}\n"
          f"  failures {a['failure_share']:.2%} of the lines (budget {a['failure_budget']:.2%})"
          + (f": {', '.join(f'{k} {v}' for k, v in a['failure_reasons'].items())}" if a["failure_reasons"] else "")
          + "\n" + (f"  output {a['output']}, errors {a['errors']}\n" if outcome.finished else ""))
