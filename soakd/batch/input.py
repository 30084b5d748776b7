"""The OpenAI Batch API input file: one JSON object per line,
``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``.

Every line is checked; a line that cannot be sent (not JSON, a field missing or wrong, a
``custom_id`` seen before) is a *bad line*: it names its line number and field, goes to the error
file, and the rest of the batch runs. A line that is not UTF-8 is a bad line too (never sent with
its bytes replaced). Blank lines are skipped (not counted). A file with no line at all, or with
no line that can be sent, is an ``InputError`` (exit 2): there is no batch to run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# the endpoints a batch may name -> the path under the target's base URL (which ends in /v1)
URLS = {"/v1/chat/completions": "/chat/completions", "/v1/completions": "/completions",
        "/v1/embeddings": "/embeddings", "/v1/responses": "/responses"}


@dataclass(frozen=True)
class BatchLine:
    line_no: int
    custom_id: str
    url: str
    body: dict[str, Any]

    @property
    def path(self) -> str:
        return URLS[self.url]


@dataclass(frozen=True)
class BadLine:
    line_no: int
    custom_id: str | None
    field: str
    message: str

    def error(self) -> dict[str, Any]:
        return {"code": "invalid_input", "message": f"line {self.line_no}: {self.field}: {self.message}",
                "line": self.line_no, "param": self.field}


class InputError(Exception):
    """The input file cannot be read at all."""


def read_input(path: Path) -> tuple[list[BatchLine], list[BadLine], str]:
    """(good lines, bad lines, the file's sha256)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read the batch input {path}: {exc.strerror or exc}") from None
    sha = hashlib.sha256(raw).hexdigest()
    good: list[BatchLine] = []
    bad: list[BadLine] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(raw.splitlines(), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad.append(BadLine(n, None, "line", f"not UTF-8 (byte {line[exc.start]:#04x} at column {exc.start + 1})"))
            continue
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except ValueError as exc:
            bad.append(BadLine(n, None, "line", f"not JSON ({exc.msg} at column {exc.colno})"))
            continue
        if not isinstance(obj, dict):
            bad.append(BadLine(n, None, "line", f"expected a JSON object, got {type(obj).__name__}"))
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            bad.append(BadLine(n, None, "custom_id", "missing or not a non-empty string"))
            continue
        if cid in seen:
            bad.append(BadLine(n, cid, "custom_id", f"{cid!r} already on line {seen[cid]}: custom_ids must be unique"))
            continue
        seen[cid] = n
        method = obj.get("method", "POST")
        if method != "POST":
            bad.append(BadLine(n, cid, "method", f"must be POST, got {method!r}"))
            continue
        url = obj.get("url")
        if url not in URLS:
            bad.append(BadLine(n, cid, "url", f"must be one of {', '.join(URLS)}, got {url!r}"))
            continue
        body = obj.get("body")
        if not isinstance(body, dict):
            bad.append(BadLine(n, cid, "body", "missing or not a JSON object"))
            continue
        if url == "/v1/embeddings":
            if "input" not in body:
                bad.append(BadLine(n, cid, "body.input", "an embeddings request needs input"))
                continue
        elif url == "/v1/chat/completions":
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                bad.append(BadLine(n, cid, "body.messages", "a chat request needs a non-empty messages list"))
                continue
        elif url == "/v1/responses":
            if "input" not in body:
                bad.append(BadLine(n, cid, "body.input", "a responses request needs input"))
                continue
        elif "prompt" not in body:
            bad.append(BadLine(n, cid, "body.prompt", "a completions request needs a prompt"))
            continue
        good.append(BatchLine(n, cid, url, body))
    if not good and not bad:
        raise InputError(f"the batch input {path} has no request line (it is empty, or blank lines only)")
    if not good:
        first = "; ".join(f"line {b.line_no}: {b.field}: {b.message}" for b in bad[:3])
        raise InputError(f"the batch input {path} has no line that can be sent ({len(bad)} bad: {first}"
                         + (" ..." if len(bad) > 3 else "") + ")")
    return good, bad, sha
