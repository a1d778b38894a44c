"""Byte sizes: parsing budgets the user writes and printing sizes people can read."""

import math
import numbers
import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value) -> int | None:
    """Turn 12 * 2**30, "12GiB", "1.5 GB" or "512MiB" into bytes; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"budget must be a number of bytes or a string such as '12GiB', not {value!r}")
    if isinstance(value, numbers.Real):
        return _whole_bytes(value, value)
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read the size {value!r}: write a number with an optional unit "
                "(B, KB, MB, GB, KiB, MiB, GiB, TiB), for example '12GiB' or '800MB'")
        if _UNITS[unit] == 1:
            return _whole_bytes(float(match.group(1)), value)
        size = int(float(match.group(1)) * _UNITS[unit])
        if size <= 0:
            raise ValueError(f"the size {value!r} must be positive")
        return size
    raise ValueError(f"budget must be bytes (int) or a string such as '12GiB', not {type(value).__name__}")


def _whole_bytes(number, shown) -> int:
    """A count of bytes must be finite and whole: 1.5 bytes is almost surely 1.5 GiB meant, and
    truncating it would plan for a 1-byte budget."""
    exact = isinstance(number, numbers.Integral)
    if not exact and not math.isfinite(number):
        raise ValueError(f"budget must be a finite number of bytes, got {shown!r}; "
                         "pass bytes or a string such as '12GiB'")
    if number <= 0:
        raise ValueError(f"budget must be positive, got {shown!r}; "
                         "pass bytes or a string such as '12GiB'")
    if not exact and not float(number).is_integer():
        raise ValueError(f"budgets are counted in bytes and {shown!r} is not a whole number "
                         "of bytes; to mean gigabytes pass a string such as '1.5GiB'")
    return int(number)


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as GPU memory is counted."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"
