"""The emulated API server of the operator's integration tests: ``kvpool-operator cluster``'s.

Why a module here: the tests import it by this name. The server grew out of this file into
``kvpool.operator.cluster.apiserver`` (kmock's emulator taught uid/resourceVersion/generation,
the four patch types, the status and scale subresources, finalizers and garbage collection,
list -> watch continuity with bookmarks and 410 Gone, label and field selectors). Here it runs
with ``declare_kvpool=True``: the three kinds are served without their CRD, so nothing is
pruned, defaulted or validated before the operator sees it, and no webhook is called (the
webhook tests post AdmissionReviews themselves); ``kvpool-operator cluster`` installs the CRDs
through Helm and calls the webhooks (e2e/tests/test_cluster.py).
"""

from kvpool.operator.cluster.apiserver import ApiServer, widen_backlog

__all__ = ["ApiServer", "widen_backlog"]
