"""``kvpool-operator cluster``: a local Kubernetes control plane for one machine.

Why it exists: users meet kvpool through ``helm install``, ``kubectl apply`` and ``kubectl get``.
No real API server can run on these machines, so this package serves what the real clients need
(an API server grown from kmock's emulator: discovery, OpenAPI, structural validation with CEL,
Table output, selectors, subresources, garbage collection, admission webhooks, watch bookmarks)
and runs what the operator creates (workload controllers and a kubelet that runs pods as local
processes through ``kvpool-operator up``'s runner). It is for trying kvpool and for the e2e
suite, never for production; the README lists what a real API server does differently.

Pure cores (no I/O): ``selectors``, ``openapi``, ``protobuf``, ``structural``, ``tables``,
``patches``, ``workloads``. The rest serves HTTP, runs processes or reads files.
"""
