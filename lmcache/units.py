"""Parsing and printing byte sizes ("4GiB", "500MB", 1048576)."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Return a byte count from an int, a float or a string such as ``"4GiB"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB,
    TiB) powers of 1024. Raises ``ValueError`` naming the value otherwise.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '4GiB' or a number of bytes, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value or value in (float("inf"),):
            raise ValueError(f"a size must be a finite number of bytes >= 0, got {value}")
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = m.group(2).lower()
            if unit in _UNITS:
                n = float(m.group(1)) * _UNITS[unit]
                if n == float("inf"):
                    raise ValueError(f"{value!r} is too large a size")
                return int(n)
        raise ValueError(
            f"cannot read {value!r} as a size: use a number of bytes or a number with "
            "a unit (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    raise ValueError(f"expected a size such as '4GiB' or a number of bytes, got {value!r}")


def format_size(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)")


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as ``"90s"``, ``"15m"``, ``"1h30m"``,
    ``"2d"`` (units s, m, h, d, w; a bare number is seconds). Raises ``ValueError``
    naming the value otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '1h' or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or value != value:
            raise ValueError(f"a duration cannot be negative or NaN, got {value}")
        return float(value)
    if isinstance(value, str):
        text = value.strip().replace(" ", "")
        total, pos = 0.0, 0
        for m in _DURATION_RE.finditer(text):
            unit = m.group(2).lower()
            if m.start() != pos or unit not in _DURATION_UNITS:
                break
            total += float(m.group(1)) * _DURATION_UNITS[unit]
            pos = m.end()
        else:
            if text and pos == len(text):
                return total
        raise ValueError(
            f"cannot read {value!r} as a duration: use a number of seconds or numbers with units "
            "(s, m, h, d, w), e.g. '90s', '15m', '1h30m', '2d'"
        )
    raise ValueError(f"expected a duration such as '1h' or a number of seconds, got {value!r}")


def format_duration(seconds: float) -> str:
    """``5400`` -> ``"1h30m"``; under a minute, whole seconds (``"42s"``)."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            major, rest = divmod(s, n)
            minor = {"d": ("h", 3600), "h": ("m", 60), "m": ("s", 1)}[unit]
            r = rest // minor[1]
            return f"{major}{unit}{r}{minor[0]}" if r else f"{major}{unit}"
    return f"{s}s"  # pragma: no cover
