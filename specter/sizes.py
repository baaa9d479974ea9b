"""Byte sizes: parse "6GiB" / "1.5GB" / 1024, and print them back for humans."""
from __future__ import annotations

import numbers
import re
from fractions import Fraction

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)  # ASCII digits only
_FORMS = ("a byte count such as 1024, or a number with a unit: B, KiB/MiB/GiB/TiB (binary, 1024-based) "
          "or KB/MB/GB/TB (decimal, 1000-based), e.g. '6GiB', '512 MiB', '1.5GB'")


def parse_size(text: str | int) -> int:
    """Bytes in `text`: "6GiB", "512MiB", "1.5GB", "300MB", "1024" or 1024. Case-insensitive, spaces ok."""
    if isinstance(text, numbers.Integral) and not isinstance(text, bool):  # numpy's too
        text = int(text)
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"size must be {_FORMS}; got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative; got {text}")
        return text
    if text.strip().startswith("-"):
        raise ValueError(f"size must not be negative; got {text!r}")
    m = _PATTERN.fullmatch(text)
    if m is None or m.group(2).lower() not in _UNITS | {"": 1}:
        raise ValueError(f"cannot parse size {text!r}: expected {_FORMS}")
    unit = _UNITS.get(m.group(2).lower(), 1)
    nbytes = Fraction(m.group(1)) * unit
    if nbytes.denominator != 1 and unit == 1:
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(nbytes)  # with a unit, whole bytes down: '10.1GiB' is 10844792422


def format_size(nbytes: int, up: bool = False) -> str:
    """Human-readable binary size: 12 -> "12 B", 512 MiB -> "512.0 MiB", 6 GiB -> "6.00 GiB". `up`: rounded
    up at the precision shown, not to the nearest (a need that, given back as a budget, is enough)."""
    sign, n = ("-" if nbytes < 0 else ""), abs(nbytes)
    if n < 1024:
        return f"{sign}{n} B"
    for i, unit in enumerate(("KiB", "MiB", "GiB", "TiB"), 1):
        x = n / 1024 ** i
        if round(x, 1) < 1024 or unit == "TiB":
            digits = 2 if x < 10 else 1
            if up:  # (integers: exact at any size)
                x = -(-n * 10 ** digits // 1024 ** i) / 10 ** digits
            return f"{sign}{x:.{digits}f} {unit}"
    raise AssertionError("unreachable")
