"""Replicas behind one endpoint on Ray Serve (docs/scaling.md).

``launch``: the Ray Serve application and ``jaxserve serve --data-parallel-size N``;
``frontend``: the ingress that routes; ``routing``: conversation affinity (no Ray);
``replica``: one engine + the single server's app per replica; ``asgi_bridge``:
serving a forwarded request through that app in-process; ``kv_transfer``:
prefill/decode disaggregation. Only this package imports Ray; the
single-engine path never imports it.
"""
