"""The simulated engine's core: performance model, tiered KV cache and continuous batching.

Why this package exists: two components run the same simulated engine and must agree on it
exactly. The worker's ``--engine sim`` drives it in real time behind the OpenAI API and the real
LMCache controller protocol; the gateway's ``kvpool-gateway simulate`` drives it in virtual time
inside a discrete-event loop, with the gateway's real routing core and the real chunk index. The
simulator is validated against the worker (same trace, same fleet), which means only if both run
this one implementation. Pure: no I/O, no clock (the caller passes the time), no threads.

- :mod:`.profile` — the performance model and its profiles (data files that cite their source);
- :mod:`.kvcache` — per-tier bounded LRU caches at LMCache chunk granularity (device, DDR, disk);
- :mod:`.instance` — one engine instance: queue, continuous batching, prefix hits, stores.
"""
