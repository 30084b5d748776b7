"""structlog's production recipe: JSON lines to stdout (console renderer on a TTY), contextvars,
ISO UTC timestamps; aiohttp's and APScheduler's stdlib logs rendered the same way."""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def use_console(fmt: str) -> bool:
    return fmt == "console" or (fmt == "auto" and sys.stdout.isatty())


def _ms(q: object, key: str) -> str | None:
    v = q.get(key) if isinstance(q, dict) else None
    return None if v is None else f"{v * 1000:.1f}ms"


def _console_window(_logger: object, _name: str, event: dict) -> dict:
    """On a terminal, ``window_closed`` in a few numbers; the JSON lines carry the whole summary."""
    if event.get("event") != "window_closed":
        return event
    out = {k: event[k] for k in ("event", "level", "timestamp", "window", "partial", "requests", "error_rate")
           if k in event}
    out.update(req_s=round(event.get("requests_per_second") or 0.0, 2),
               tok_s=round(event.get("output_tokens_per_second") or 0.0, 1),
               e2e_p50=_ms(event.get("e2e_seconds"), "p50"), e2e_p95=_ms(event.get("e2e_seconds"), "p95"),
               ttft_p95=_ms(event.get("ttft_seconds"), "p95"), itl_p95=_ms(event.get("itl_seconds"), "p95"))
    if event.get("drift"):
        out["drift"] = event["drift"]
    return out


def configure(fmt: str = "auto", level: str = "info") -> None:
    lvl = _LEVELS.get(level, logging.INFO)
    console = use_console(fmt)
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
        if console
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info if not console else structlog.processors.ExceptionPrettyPrinter(),
            structlog.processors.UnicodeDecoder(),
            renderer,
        ]
        if not console
        else [*shared, _console_window, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=False,
    )
    # stdlib loggers (aiohttp, apscheduler) through the same renderer
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(lvl, logging.WARNING))
    for noisy in ("aiohttp.access", "apscheduler.executors.default"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # skipped and missed runs are counted and logged by soakd's own scheduler listener
    logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)
