"""Quantities with units, parsed from the command line and written into tables.

Shared by ``plan`` and ``bench`` so that neither tool imports the other.
"""

from __future__ import annotations

import re

__all__ = ["format_bytes", "format_seconds", "parse_bandwidth", "parse_duration", "parse_size"]

_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ]*)\s*(/s)?\s*$")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
# Case matters only for b (bit) vs B (byte), as in "Gb" vs "GB".
_BIT_SUFFIXES = (("bps", 8), ("Bps", 1), ("bits", 8), ("bit", 8), ("bytes", 1), ("byte", 1),
                 ("b", 8), ("B", 1))


def _parse_bytes(text: str, what: str, examples: str) -> float:
    m = _QUANTITY.match(str(text))
    if m:
        value, unit = float(m[1]), m[2]
        divisor = 1 if unit == "" else None  # a bare number is bytes
        for suffix, div in _BIT_SUFFIXES:
            if unit.endswith(suffix):
                unit, divisor = unit[: -len(suffix)], div
                break
        scale = _PREFIX.get(unit.lower())
        if divisor is not None and scale is not None:
            return value * scale / divisor
    raise ValueError(f"cannot parse {text!r} as {what} (examples: {examples})")


def parse_bandwidth(text: str) -> float:
    """Bytes per second from "10Gbit", "200Mbit/s", "10Gbps", "25GB", "1.5GB/s" or a number.

    Lower-case ``b``/``bit``/``bps`` means bits (divided by 8), ``B`` bytes; k/M/G/T are
    powers of 1000 and Ki/Mi/Gi/Ti powers of 1024. A bare number is bytes/s.
    """
    value = _parse_bytes(text, "a bandwidth", "10Gbit, 200Mbit/s, 25GB, 1.5GB/s")
    if value <= 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}")
    return value


def parse_size(text: str) -> int:
    """Bytes from "16GB", "512MiB", "1e9" (bits such as "8Gbit" are divided by 8)."""
    return round(_parse_bytes(text, "a size", "16GB, 512MiB, 1e9"))


def parse_duration(text: str) -> float:
    """Seconds from "50us" (or "50µs"), "1.5ms", "2s", "100ns" or a bare number of seconds."""
    m = _QUANTITY.match(str(text))
    units = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    if m and not m[3] and m[2].lower() in units:
        return float(m[1]) * units[m[2].lower()]
    raise ValueError(f"cannot parse {text!r} as a duration (examples: 50us, 1.5ms, 2s)")


def format_bytes(n: float) -> str:
    """Decimal units, as in "16GB": ``format_bytes(1.6e10) == "16 GB"``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """``0.0123 -> "12.3 ms"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns" if s > 0 else "0"
