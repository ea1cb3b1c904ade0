"""CPU, cache and NUMA topology discovered from sysfs."""

from .discover import Cache, Cpu, NumaNode, Topology, discover

__all__ = ["Cache", "Cpu", "NumaNode", "Topology", "discover"]
