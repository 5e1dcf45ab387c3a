"""Run a rendered cache domain on this machine: ``kvpool-operator up`` / ``down``.

``plan`` (pure) turns the operator's objects into local workloads and checks the rewrite;
``stack`` runs them as processes; ``up`` is the command; ``demo`` replays an agent workload
through the gateway of a domain that is up.
"""
