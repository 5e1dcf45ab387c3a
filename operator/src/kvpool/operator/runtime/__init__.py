"""The operator's runtime: kopf handlers (thin), the reconcile loop and the admission webhook.

Everything that decides (validation, render, status, fingerprint) lives in the pure cores
(api/, render/, validation/, status.py); this package reads the cluster, calls them, applies
the result and patches status. Only ``handlers`` and ``main`` import kopf.
"""
