"""The kvpool operator: the cache-domain contract for KVCachePool, P2PGroup and PDPair.

API models (api/) are the single source of truth for the CRDs; render/ and validation/ are
pure functions over them; the kopf glue and the dry-run CLI are thin layers on top.
"""
