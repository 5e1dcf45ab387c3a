"""``kvpool-gateway simulate``: a fleet of simulated engines in virtual time, routed by the
gateway's own routing core.

Why this package exists: whether KV-aware routing pays, and how many instances a workload needs,
are questions about fleets of tens to a thousand instances replaying hours of traffic; no one
box runs that over sockets. This discrete-event simulator runs the parts that decide it, with no
sockets and no clock: the gateway's real :class:`~kvpool.gateway.selection.Selector` (candidates,
pending prefixes, load tracker, the registered policies), the real chunk index
(:mod:`kvpool.protocol.index`, fed by the engines' admit and evict events after a modelled
lag) and the simulated engine's core (:mod:`kvpool.protocol.simcore`, the same code the
workers' ``--engine sim`` runs). It is validated against a run of the same trace window over
real sockets and sim workers (``make bench-fleet``).

- :mod:`.keys` — a trace row's chunk hashes without building its tokens;
- :mod:`.fleet` — the event loop and its configuration;
- :mod:`.stats` — what a run measured (TTFT, TPOT, hit ratio, goodput, per-instance load);
- :mod:`.planner` — the capacity planner (smallest fleet meeting a TTFT target);
- :mod:`.cli` — the ``simulate`` and ``plan`` subcommands.
"""
