"""The kvpool KV controller: knows where every KV chunk of a cache domain lives.

It speaks LMCache's controller wire protocol so stock LMCache workers register unchanged, and
adds what LMCache's controller lacks: TP-rank-aware P2P lookup, heartbeat-TTL purge,
persistence, a longest-prefix lookup for the gateway, metrics and a domain fingerprint check.
"""
