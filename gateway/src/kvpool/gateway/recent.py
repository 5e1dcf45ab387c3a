"""The gateway's bounded memory of recent prompts and evictions, for explaining misses.

Why this module exists: to say why a chunk was cached nowhere, the gateway must remember what
it sent where (a chunk never sent was never stored; one sent to a frozen instance was dropped)
and what the index lost (an eviction is only a delta on the stream, gone once applied). Both
must stay small on a gateway that routes millions of prompts, so:

- :class:`PromptHistory` keeps recent prompts *by chunk*, keyed by the chained chunk hash:
  prompts that share a prefix share its entries (a hundred turns of one session over one
  system prompt store that prompt once). Each chunk keeps its tokens (to find the first token
  at which a new prompt differs from a cached one), its parent hash (its siblings are the
  prompts that shared everything before it) and the last few requests that carried it. Least
  recently used chunks go first once ``max_bytes`` of tokens are held.
- :class:`EvictionLog` keeps the last ``capacity`` chunk evictions in numpy columns (hash,
  time, who): appending is a vector copy, a lookup a vector compare, 20 bytes an entry. Clears
  and workers gone (no keys on the stream) are kept apart, a bounded deque.

No I/O: the glue feeds them (the routing decisions, the index client's delta batches).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvpool.gateway.misses import Divergence, Eviction, Sent

__all__ = ["EvictionLog", "PromptHistory"]

_MASK64 = (1 << 64) - 1
_ROOT = object()  # the parent of every first chunk
SENT_PER_CHUNK = 4  # requests remembered per chunk (the latest)
MAX_SIBLINGS = 4096  # chunks compared when looking for the closest prompt
WINDOW_BEFORE, WINDOW_AFTER = 4, 8  # tokens shown around a divergence


@dataclass
class _Chunk:
    parent: object  # parent chunk hash, or _ROOT
    tokens: array[int]
    sent: deque[Sent] = field(default_factory=lambda: deque(maxlen=SENT_PER_CHUNK))


class PromptHistory:
    """Recent prompts by chained chunk hash (see the module docstring); at most ``max_bytes``
    of token ids (8 bytes each) plus a small constant per chunk."""

    def __init__(self, chunk_size: int, max_bytes: int) -> None:
        self.chunk_size = chunk_size
        self.max_chunks = max(1, max_bytes // (8 * chunk_size))
        self._chunks: OrderedDict[int, _Chunk] = OrderedDict()
        self._children: dict[object, set[int]] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def record(
        self, tokens: Sequence[int], hashes: Sequence[int], sent: Sent, *, first: int = 0
    ) -> None:
        """``sent`` carried the prompt ``tokens`` (full chunks ``hashes``) from chunk
        ``first`` on (the chunks before it are already recorded for this request)."""
        cs = self.chunk_size
        chunks = self._chunks
        parent: object = hashes[first - 1] if first > 0 else _ROOT
        for k in range(first, len(hashes)):
            h = hashes[k]
            entry = chunks.get(h)
            if entry is None:
                entry = chunks[h] = _Chunk(parent, array("q", tokens[k * cs : (k + 1) * cs]))
                self._children.setdefault(parent, set()).add(h)
            else:
                chunks.move_to_end(h)
            entry.sent.append(sent)
            parent = h
        while len(chunks) > self.max_chunks:
            h, old = chunks.popitem(last=False)
            kids = self._children.get(old.parent)
            if kids is not None:
                kids.discard(h)
                if not kids:
                    del self._children[old.parent]

    def sent(self, h: int) -> tuple[Sent, ...]:
        """The latest requests that carried chunk ``h`` (oldest first); () if forgotten."""
        entry = self._chunks.get(h)
        return tuple(entry.sent) if entry is not None else ()

    def tokens(self, h: int) -> array[int] | None:
        """The tokens of chunk ``h`` (None if forgotten)."""
        entry = self._chunks.get(h)
        return entry.tokens if entry is not None else None

    def closest(
        self, chunk: Sequence[int], parent: int | None, own: int | None, k: int, before: float
    ) -> Divergence | None:
        """Among the recorded chunks after ``parent`` (None: first chunks) other than ``own``,
        carried before ``before``: the one sharing the most leading tokens with ``chunk`` (the
        tokens of this prompt's chunk ``k``), and the first token where it differs; None when
        no recorded prompt continued this prefix differently."""
        cs = self.chunk_size
        ours = np.asarray(chunk, dtype=np.int64)
        best: tuple[int, _Chunk] | None = None
        siblings = self._children.get(_ROOT if parent is None else parent, ())
        for n, h in enumerate(siblings):
            if n >= MAX_SIBLINGS:
                break
            entry = self._chunks.get(h)
            if entry is None or h == own or not any(s.at <= before for s in entry.sent):
                continue
            theirs = np.frombuffer(entry.tokens, dtype=np.int64)
            m = min(len(theirs), len(ours))
            diff = np.flatnonzero(theirs[:m] != ours[:m])
            same = int(diff[0]) if len(diff) else m
            if same == m:
                continue  # one is a prefix of the other: no token differs
            if best is None or same > best[0]:
                best = (same, entry)
        if best is None:
            return None
        same, entry = best
        lo = max(0, same - WINDOW_BEFORE)
        theirs_t = tuple(int(t) for t in entry.tokens[lo : same + WINDOW_AFTER])
        ours_t = tuple(int(t) for t in ours[lo : same + WINDOW_AFTER])
        last = [s for s in entry.sent if s.at <= before][-1]
        start = k * cs
        return Divergence(
            last.request_id, last.instance, last.at, start + same, start + lo, ours_t, theirs_t
        )


class EvictionLog:
    """The last ``capacity`` chunk evictions the index reported (numpy ring) and the last
    ``events`` clears and workers gone (see the module docstring)."""

    def __init__(self, capacity: int, events: int = 1024) -> None:
        self.capacity = max(1, capacity)
        self._hash: npt.NDArray[np.uint64] = np.zeros(self.capacity, dtype=np.uint64)
        self._at: npt.NDArray[np.float64] = np.zeros(self.capacity, dtype=np.float64)
        self._who: npt.NDArray[np.int32] = np.zeros(self.capacity, dtype=np.int32)
        self._next = 0  # next slot to write
        self._count = 0  # slots written (<= capacity)
        self._where: dict[tuple[str, str], int] = {}
        self._names: list[tuple[str, str]] = []
        self.events: deque[Eviction] = deque(maxlen=events)

    def __len__(self) -> int:
        return self._count

    def _code(self, instance: str, location: str) -> int:
        key = (instance, location)
        code = self._where.get(key)
        if code is None:
            if len(self._names) >= 1 << 20:  # ids churned past any real pool: start over
                self._where.clear()
                self._names.clear()
                self._count = self._next = 0
            code = self._where[key] = len(self._names)
            self._names.append(key)
        return code

    def evicted(self, instance: str, location: str, keys: Iterable[int], at: float) -> None:
        """``keys`` left ``instance``'s ``location`` at ``at``."""
        new = np.fromiter((k & _MASK64 for k in keys), dtype=np.uint64)
        if len(new) > self.capacity:
            new = new[-self.capacity :]
        n = len(new)
        if n == 0:
            return
        code = self._code(instance, location)
        end = self._next + n
        if end <= self.capacity:
            spans = [(self._next, end, 0, n)]
        else:
            first = self.capacity - self._next
            spans = [(self._next, self.capacity, 0, first), (0, n - first, first, n)]
        for a, b, i, j in spans:
            self._hash[a:b] = new[i:j]
            self._at[a:b] = at
            self._who[a:b] = code
        self._next = end % self.capacity
        self._count = min(self.capacity, self._count + n)

    def lost(self, instance: str, location: str, at: float, op: str) -> None:
        """Every chunk of a worker of ``instance`` at ``location`` went (clear, worker down)."""
        self.events.append(Eviction(instance, location, at, op))

    def of(self, h: int) -> list[Eviction]:
        """The remembered evictions of chunk ``h``, oldest first."""
        found = np.flatnonzero(self._hash[: self._count] == np.uint64(h & _MASK64))
        out = [
            Eviction(*self._names[int(self._who[i])], float(self._at[i]), "evict") for i in found
        ]
        return sorted(out, key=lambda e: e.at)
