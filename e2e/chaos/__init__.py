"""The chaos suite (``make chaos``; e2e/README.md): kvpool under faults and load.

Why a package: the command (``python -m chaos`` from e2e/), the reduced run the e2e suite asserts
on (``tests/test_chaos_reduced.py``) and the full one share the same parts: the network
namespace and the cut (:mod:`.netns`), the load (:mod:`.workload`), the faults (:mod:`.faults`),
the verdict (:mod:`.measure`) and the run (:mod:`.suite`).
"""
