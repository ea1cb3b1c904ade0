"""CRI relay between kubelet and the container runtime (``cri-resmgr relay``; docs/relay.md).

Modules: ``h2proxy`` (HTTP/2 frame forwarding), ``core`` (hooks, cache, placement, reconcile, moves),
``allocator`` (topology-aware CPU choice), ``estimate`` (requests and QoS from CRI resources), ``cache``
(persisted state), ``runtime`` (the relay's own CRI client), ``control`` (control socket), ``stats``
(metrics), ``dump`` (message dump), ``server`` (the process).
"""
