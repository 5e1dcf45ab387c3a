"""Kubernetes quantities ("8Gi", "500M", "1.5Gi") parsed to integers.

Why: every size in the API (CPU cache, staging arena, PD buffer) is written the way Kubernetes
users write memory, but LMCache wants bytes (or GB floats) and the budget maths wants integers.
One parser, exact on the binary suffixes, shared by the models and the renderer.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, Decimal] = {
    "": Decimal(1),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?\s*$")

GIB = 2**30


def parse_quantity(value: object) -> int:
    """Return ``value`` (an int or a Kubernetes quantity string) as a whole number of units.

    Raises ValueError with a message saying what a valid quantity looks like.
    """
    if isinstance(value, bool):
        raise ValueError("expected a size such as 8Gi or a number of bytes, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != int(value):
            raise ValueError(f"size must be a whole non-negative number of bytes, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as 8Gi, got {type(value).__name__}")
    match = _QUANTITY.match(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not a Kubernetes quantity; write e.g. 8Gi, 512Mi, 2G or 1073741824"
        )
    try:
        number = Decimal(match.group(1)) * _SUFFIXES[match.group(2) or ""]
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"{value!r} is not a number") from exc
    if number != number.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(number)


def format_bytes(value: int) -> str:
    """Render a byte count the short way a person reads it (binary units, e.g. ``24Gi``)."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if value >= unit and value % unit == 0:
            return f"{value // unit}{suffix}"
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if value >= unit:
            return f"{value / unit:.2f}{suffix}"
    return str(value)
