"""NRI front end: cri-resmgr as a plugin of containerd >= 1.7 / CRI-O >= 1.26 (docs/nri.md).

Layers, each usable and tested alone: :mod:`.mux` (NRI's multiplexed unix socket), :mod:`.ttrpc` (the RPC
protocol on each multiplexed connection), :mod:`.proto` (the messages), :mod:`.connection` (both services of
one socket), :mod:`.plugin` (runtime events turned into placement-engine calls), :mod:`.server` (the process).
"""
