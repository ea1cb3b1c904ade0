"""The placement engine (one for every front end): container cache, CPU allocation and reservations,
the shared pool, reconcile, invariants checked against the kernel, moves, and the hook point for resource
controllers. It knows nothing of HTTP/2, gRPC framing or ttrpc. The API is :class:`.engine.Engine`;
front ends are :mod:`cri_resmgr.relay` (CRI) and :mod:`cri_resmgr.nri` (NRI).
"""
