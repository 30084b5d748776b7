"""Byte sizes as users write them: ``1073741824``, ``512MiB``, ``1GiB``, ``2GB``."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator

GIB = 1024**3

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_MULT = {
    None: 1, "b": 1,
    "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": GIB, "gib": GIB, "ti": 1024**4, "tib": 1024**4,
}  # fmt: skip


def parse_bytes(value: Any) -> float:
    """A byte size in bytes; ValueError naming the accepted forms otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 512MiB or 1GiB, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            unit = m.group(2).lower() if m.group(2) else None
            return float(m.group(1)) * _MULT[unit]
    raise ValueError(f"expected a size like 512MiB, 1GiB or a number of bytes, got {value!r}")


Bytes = Annotated[float, BeforeValidator(parse_bytes)]
