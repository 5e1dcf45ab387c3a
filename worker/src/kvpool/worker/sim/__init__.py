"""The simulated engine (``kvpool-worker serve --engine sim``): a worker in every respect but the
model math.

Why this package exists: fleet-scale questions (does KV-aware routing beat approximate routers
with tens of instances whose caches are smaller than the working set? do the controller and the
gateway hold up?) cannot be answered with real engines on a CPU box. The simulated engine runs
:mod:`kvpool.protocol.simcore` (the performance model, tiered caches and continuous batching the
gateway's fleet simulator runs in virtual time) in wall time behind the worker's real HTTP
runtime, and speaks LMCache's real controller protocol with LMCache-exact chunk hashes, so the
controller's index and the gateway's replica cannot tell it from a real worker.

- :mod:`.config` — what the sim reads of the rendered LMCache config and the flags (pure);
- :mod:`.build` — settings and environment to a ready-to-start :class:`~.engine.SimEngine`;
- :mod:`.engine` — the asyncio driver: model time to wall time, token streams, abort, shutdown;
- :mod:`.memory` — the agent memory API and the controller's cache commands over simcore;
- :mod:`.kv_batch`, :mod:`.lmcache_client`, :mod:`.full_sync`, :mod:`.control` — LMCache
  0.5.6's worker side of the controller protocol (admit/evict batches, register, heartbeat,
  P2P lookup, full sync with freeze, the REP socket's commands, deregistration);
- :mod:`.host` — ``kvpool-worker host``: many instances in one process;
- :mod:`.calibrate` — ``kvpool-worker calibrate``: a profile fitted to the reference engine here
  (imports torch and LMCache; only that command loads it).
"""
