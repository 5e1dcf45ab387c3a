"""What the operator, the gateway and a PD decode worker agree on about unclaimed transfers.

Why this module exists: LMCache 0.5.6 frees a PD receiver's buffer only when the decoder
retrieves the transferred KV, so a transfer nobody decodes (a prefill-only answer, a client
gone, a gateway restart) stays in the buffer until every later push waits forever for space.
kvpool closes that from both ends: the decode worker frees what stays unclaimed longer than a
TTL the operator renders (one ``extra_config`` key of the decoder's LMCache config), and the
gateway tells the decoder at once about a transfer it will not claim (``POST`` of the
prompt's token ids to :data:`RELEASE_PATH`). The key, its default and bounds, the path and
the body are written once, here.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "DEFAULT_UNCLAIMED_TTL_SECONDS",
    "MAX_UNCLAIMED_TTL_SECONDS",
    "MIN_UNCLAIMED_TTL_SECONDS",
    "RELEASE_PATH",
    "UNCLAIMED_TTL_KEY",
    "release_body",
]

#: The decode worker's LMCache ``extra_config`` key: seconds a transfer may wait to be claimed.
UNCLAIMED_TTL_KEY = "kvpool_pd_unclaimed_ttl_seconds"
#: Twice the gateway's default wait for a transfer to land (``pdTransferTimeoutSeconds``, 30 s):
#: a decode claims its transfer within moments of the landing, and only transfers nobody will
#: claim live this long. At the demo's 28 MB per 7K-token prompt and a 256 MiB buffer, that is
#: nine abandoned prompts a minute before a push has to wait (it then waits at most the TTL).
DEFAULT_UNCLAIMED_TTL_SECONDS = 60.0
#: Below this a slow transfer (the sender writes after the receiver allocated) could be freed
#: while its bytes are still arriving.
MIN_UNCLAIMED_TTL_SECONDS = 5.0
MAX_UNCLAIMED_TTL_SECONDS = 3600.0

#: The decode worker's endpoint that frees the transfer of one prompt (internal, like /memory).
RELEASE_PATH = "/pd/release"


def release_body(req_id: str, prompt_token_ids: Sequence[int]) -> dict[str, object]:
    """The JSON body of a release: the prompt the prefill transferred (the decoder finds the
    transfer by the prompt's chunk keys; LMCache's allocation request carries no request id)
    and the request id, for the decoder's log."""
    return {"req_id": req_id, "prompt_token_ids": list(prompt_token_ids)}
