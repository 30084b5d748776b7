"""The inference server's version, asked once: what a fleet's pods must share to be compared (``soakd_server_info``'s
``version`` label, ``soakd_target_info``'s ``server_version``).

Each server says it at its own path (read from each server's source): vLLM ``GET /version``
(``{"version": "0.11.0"}``; soakd's simulator too), SGLang ``GET /get_server_info`` (``version``), TGI
``GET /info`` (``version``), llama.cpp's llama-server ``GET /props`` (``build_info``). The first JSON
object with a non-empty field wins; a server that says none of them has no version (an empty label).
"""

from __future__ import annotations

import json

import aiohttp

from soakd.samplers.promtext import ScrapeError, fetch

__all__ = ["VERSION_PATHS", "server_version"]

VERSION_PATHS: tuple[tuple[str, str], ...] = (
    ("/version", "version"),
    ("/get_server_info", "version"),
    ("/info", "version"),
    ("/props", "build_info"),
)
_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
MAX_LENGTH = 64  # a label value, not a document


async def server_version(session: aiohttp.ClientSession, origin: str) -> str | None:
    """The server at ``origin`` (scheme://host:port)'s version, or None where no path gives one."""
    for path, key in VERSION_PATHS:
        try:
            text, _ = await fetch(session, origin.rstrip("/") + path, timeout=_TIMEOUT, limit=1 << 20)
        except ScrapeError:
            continue
        try:
            doc = json.loads(text)
        except ValueError:
            continue
        value = doc.get(key) if isinstance(doc, dict) else None
        if isinstance(value, str | int | float) and not isinstance(value, bool) and str(value).strip():
            return str(value).strip()[:MAX_LENGTH]
    return None
