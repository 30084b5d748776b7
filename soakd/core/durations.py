"""Durations as users write them: ``45s``, ``30m``, ``12h``, ``1h30m``, ``250ms`` or a number of seconds."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(value: Any) -> float:
    """Return seconds. Raises ValueError with the accepted forms on bad input."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 45s, 30m or 12h, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        try:
            seconds = float(text)
        except ValueError:
            pos, seconds = 0, 0.0
            for match in _PART.finditer(text):
                if match.start() != pos:
                    break
                seconds += float(match.group(1)) * _UNITS[match.group(2)]
                pos = match.end()
            if text.startswith("-") and text != "-":
                raise ValueError(f"a duration cannot be negative, got {value!r}") from None
            if pos != len(text) or not text:
                raise ValueError(
                    f"expected a duration like 45s, 30m, 12h or 1h30m, got {value!r}"
                ) from None
    else:
        raise ValueError(f"expected a duration like 45s, 30m or 12h, got {value!r}")
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest exact form: 43200 -> '12h', 90 -> '1m30s', 0.25 -> '250ms'."""
    if seconds == 0:
        return "0s"
    if seconds < 1 or seconds != int(seconds):
        if (seconds * 1000) == int(seconds * 1000) and seconds < 1:
            return f"{int(seconds * 1000)}ms"
        return f"{seconds:g}s"
    rest, out = int(seconds), ""
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            out += f"{rest // size}{unit}"
            rest %= size
    return out


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
"""A pydantic field type: accepts '30m' or 1800, holds seconds as float, dumps as '30m'."""
