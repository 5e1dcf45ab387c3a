"""PD bypass: whether a PD request goes straight to a decode instance that holds its prompt.

Why this module exists: a decode instance with a CPU tier keeps each request it finished
(prompt and answer, whole chunks; worker ``pd_keep``), so the next turn of a conversation is
mostly on that decoder already. Prefilling it elsewhere and transferring the whole prompt's KV
again costs a prefill, a transfer and a second hop; the decoder itself loads what it holds and
prefills only the rest. This pure core decides from the decode candidates (what the index and
the pending entries say each holds) and the pair's ``bypassMinCachedRatio``; ``pd_flow`` acts
on it and records it (explain step, ``kvpool_gateway_pd_paths_total``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.gateway.candidates import Candidates

#: The decision's reason (route reason, explain step, metric label) when bypassed.
PD_BYPASS = "pd-bypass"
#: ``kvpool_gateway_pd_paths_total`` labels: path, reason.
PATH_BYPASS, PATH_PREFILL = "bypass", "prefill"
REASON_CACHED = "decoder-cached"  # bypassed: the decoder holds at least the share
REASON_BELOW = "below-ratio"  # bypass on, no decoder holds the share
REASON_OFF = "bypass-off"  # the pair's ratio is 0 (or absent)


@dataclass(frozen=True)
class BypassVerdict:
    """The best-holding decode candidate (``position`` in the candidates, -1: none), the prompt
    tokens it holds, their share of the prompt, the threshold, and whether to bypass."""

    position: int
    cached_tokens: int
    share: float
    ratio: float
    bypass: bool

    @property
    def reason(self) -> str:
        if self.ratio <= 0:
            return REASON_OFF
        return REASON_CACHED if self.bypass else REASON_BELOW

    def note(self, names: Sequence[str], prompt_tokens: int) -> str:
        """The explain step's note: who holds how much, against which threshold."""
        who = names[self.position] if self.position >= 0 else "no decoder"
        verdict = "prefill and transfer skipped" if self.bypass else "through prefill"
        return (
            f"PD bypass: {who} holds {self.cached_tokens} of {prompt_tokens} prompt tokens "
            f"(share {self.share:.3f}, bypassMinCachedRatio {self.ratio:g}): {verdict}"
        )


def decide(cands: Candidates, prompt_tokens: int, chunk_size: int, ratio: float) -> BypassVerdict:
    """Bypass when the decode candidate holding most of the prompt (ties: fewer requests in
    flight, then the first) holds at least ``ratio`` of its tokens; ``ratio`` <= 0 never."""
    best, best_key = -1, (0, 0)
    for i in range(len(cands)):
        hit = cands.hit(i)
        cached = min(hit.hit_chunks * chunk_size, prompt_tokens) if hit is not None else 0
        key = (cached, -int(cands.inflight[i]))
        if cached > 0 and (best < 0 or key > best_key):
            best, best_key = i, key
    cached = best_key[0]
    share = cached / prompt_tokens if prompt_tokens > 0 else 0.0
    return BypassVerdict(best, cached, share, ratio, ratio > 0 and best >= 0 and share >= ratio)
