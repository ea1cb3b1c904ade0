"""cri-resmgr: a Kubernetes node agent that sees what the hardware sees per container."""

__version__ = "0.1.0"
