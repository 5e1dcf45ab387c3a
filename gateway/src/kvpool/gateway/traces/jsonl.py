"""Reading a JSONL trace, whatever its row format: streaming, windowed, errors by line and field.

Why this module exists: every trace kvpool reads (Mooncake's, kvpool's agent trace) is one JSON
object per line, and each reader must do the same things the same way: stream the file (gzip
too) without holding it, skip blank lines, decode each row with a typed msgspec struct and turn
a bad row into a :class:`TraceError` naming the file, the line and the field, and select a
:class:`Window` of requests by time and by index (stopping the read once an index window is
full). A format is then just its row struct and the request it builds from a row.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol, TypeVar, cast

import msgspec


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file, the line and the field."""

    def __init__(self, path: str, line: int | None, message: str, field: str | None = None) -> None:
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {field}: {message}" if field else f"{where}: {message}")
        self.path = path
        self.line = line
        self.field = field


@dataclass(frozen=True, slots=True)
class Window:
    """Which requests of a trace to take: first those with ``from_s <= arrival_s < to_s``
    (the trace's clock), then of those, in file order, ``count`` after skipping ``start``."""

    start: int = 0
    count: int | None = None
    from_s: float | None = None
    to_s: float | None = None

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"window start must be >= 0, got {self.start}")
        if self.count is not None and self.count < 1:
            raise ValueError(f"window count must be >= 1, got {self.count}")
        if self.from_s is not None and self.to_s is not None and self.to_s <= self.from_s:
            raise ValueError(f"window to ({self.to_s} s) must be after from ({self.from_s} s)")

    def in_time(self, arrival_s: float) -> bool:
        return (self.from_s is None or arrival_s >= self.from_s) and (
            self.to_s is None or arrival_s < self.to_s
        )


class Arrives(Protocol):
    @property
    def arrival_s(self) -> float: ...


R = TypeVar("R", bound=Arrives)
S = TypeVar("S")
#: a format's row parser: (file name, row index, line number, raw line) → request
RowParser = Callable[[str, int, int, bytes], R]

_AT_FIELD = re.compile(r"^(?P<msg>.*?) - at `\$\.(?P<field>[^`]+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


def split_msgspec_error(message: str) -> tuple[str | None, str]:
    """``(field, reason)`` of a msgspec validation message (field None when it names none)."""
    if m := _AT_FIELD.match(message):
        return m["field"], m["msg"]
    if m := _MISSING.match(message):
        return m["field"], "missing"
    return None, message


def decode_row(decoder: msgspec.json.Decoder[S], path: str, line: int, raw: bytes) -> S:
    """One row decoded by ``decoder``; a TraceError naming the line and the field otherwise."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        field, reason = split_msgspec_error(str(exc))
        raise TraceError(path, line, reason, field) from None
    except msgspec.DecodeError as exc:
        raise TraceError(path, line, f"not a JSON object ({exc})") from None


def open_bytes(path: str | Path) -> IO[bytes]:
    """The file's bytes, decompressed when its name ends in ``.gz``; OSError names the path."""
    p = Path(path)
    return cast(IO[bytes], gzip.open(p, "rb")) if p.suffix == ".gz" else p.open("rb")


def iter_rows(path: str | Path) -> Iterator[tuple[int, int, bytes]]:
    """``(index, line, raw)`` of each non-blank line, streaming; a read error is a TraceError."""
    index = 0
    try:
        with open_bytes(path) as fp:
            for lineno, raw in enumerate(fp, start=1):
                if raw.strip():
                    yield index, lineno, raw
                    index += 1
    except (OSError, EOFError) as exc:  # missing file, not gzip, truncated gzip
        raise TraceError(str(path), None, f"cannot read: {exc}") from None


def select(
    rows: Iterable[tuple[int, int, bytes]], parse: Callable[[int, int, bytes], R], window: Window
) -> Iterator[R]:
    """``window`` applied to the requests ``parse(index, line, raw)`` makes of the rows; stops
    reading once an index window is full."""
    taken = skipped = 0
    for index, line, raw in rows:
        req = parse(index, line, raw)
        if not window.in_time(req.arrival_s):
            continue
        if skipped < window.start:
            skipped += 1
            continue
        yield req
        taken += 1
        if window.count is not None and taken >= window.count:
            return


def iter_trace(path: str | Path, parse: RowParser[R], window: Window | None) -> Iterator[R]:
    """The requests of a file, in file order, streaming, ``window`` applied."""
    name = str(path)
    return select(
        iter_rows(path), lambda i, line, raw: parse(name, i, line, raw), window or Window()
    )


def read_trace(path: str | Path, parse: RowParser[R], window: Window | None) -> list[R]:
    """:func:`iter_trace` as a list; a file or window with no request is a TraceError."""
    out = list(iter_trace(path, parse, window))
    if not out:
        raise TraceError(str(path), None, "no request in the file (or in the window)")
    return out


def ms(arrival_s: float) -> int | float:
    """A request's time as a trace row writes it: milliseconds, whole when they are."""
    value = arrival_s * 1000.0
    return int(value) if value.is_integer() else value
