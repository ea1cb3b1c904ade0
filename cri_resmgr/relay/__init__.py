"""CRI relay between kubelet and the container runtime (``cri-resmgr relay``; docs/relay.md): the CRI
front end of the placement engine (:mod:`cri_resmgr.placement`).

Modules: ``h2proxy`` (HTTP/2 frame forwarding, bounded), ``core`` (a handler per intercepted CRI method, turning
calls into engine calls), ``runtime`` (the relay's own CRI client and the engine's runtime port over it),
``control`` (control socket), ``stats`` (metrics), ``dump`` (message dump), ``server`` (the process).
"""
