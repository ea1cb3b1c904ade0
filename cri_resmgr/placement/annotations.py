"""How ``cri-resmgr.io/*`` annotations are read (the one home of that rule)."""

from __future__ import annotations

import functools
from collections.abc import Mapping

PREFIX = "cri-resmgr.io/"
LATENCY_CRITICAL = PREFIX + "latency-critical"
AVX512 = PREFIX + "avx512"
AFFINITY = PREFIX + "affinity"
ANTI_AFFINITY = PREFIX + "anti-affinity"
EXCLUSIVE = PREFIX + "exclusive"
_TRUE = ("1", "true", "yes", "on")


def effective_annotations(pod: Mapping[str, str], container: Mapping[str, str], name: str) -> dict[str, str]:
    """``cri-resmgr.io/*`` settings for one container: pod annotations, overridden by the container's own,
    overridden by pod annotations ``cri-resmgr.io/<key>.container.<name>``."""
    suffix = f".container.{name}"
    out = {k: v for k, v in pod.items() if k.startswith(PREFIX) and ".container." not in k}
    out.update({k: v for k, v in container.items() if k.startswith(PREFIX)})
    for k, v in pod.items():
        if k.startswith(PREFIX) and k.endswith(suffix):
            out[k[: -len(suffix)]] = v
    return out


def prefixed(annotations: Mapping[str, str]) -> dict[str, str]:
    """The ``cri-resmgr.io/*`` entries only (a pod may carry thousands of others)."""
    return {k: v for k, v in annotations.items() if k.startswith(PREFIX)}


@functools.lru_cache(maxsize=256)
def container_refs(spec: str) -> dict[str, frozenset[str]]:
    """An (anti-)affinity list ``name`` (same pod) or ``pod/name``, as container name -> pod names ("" = the
    same pod). Cached: every container of a pod repeats its pod's list. Do not change the result."""
    out: dict[str, set[str]] = {}
    for item in (s.strip() for s in spec.split(",")):
        if item:
            pod_name, _, name = item.rpartition("/")
            out.setdefault(name, set()).add(pod_name)
    return {k: frozenset(v) for k, v in out.items()}


def truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in _TRUE
