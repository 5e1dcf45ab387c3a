"""kvpool.protocol: every truth two kvpool components must agree on, defined once.

Why this package exists: a worker, the controller, the gateway and the operator each see one
side of the same facts — the cache-domain fingerprint, how token ids become LMCache chunk
hashes, the controller's index delta stream, how chat messages become token ids. When two
copies of one of these drift apart nothing fails loudly: hits silently drop to 0 %. So each
lives here exactly once, as pure code (no sockets, files, clocks or threads), and the
import-linter contracts say that every component may import it and that it imports none of
them. Submodules:

- :mod:`kvpool.protocol.domain` — the cache-domain contract's values;
- :mod:`kvpool.protocol.hashing` — LMCache-exact chunk hashes for every regime;
- :mod:`kvpool.protocol.deltas` — the delta/snapshot wire types and the pure index replica;
- :mod:`kvpool.protocol.chat` — chat-messages-to-token-ids rendering (extra ``chat``).

Nothing is imported here, so importing one submodule never pulls another's dependencies.
"""
