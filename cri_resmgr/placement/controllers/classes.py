"""Which class a container gets: one home for the rule (docs/resource-control.md).

Most specific first:

1. ``<control>class.cri-resource-manager.intel.com/container.<name>`` (pod annotation, or the container's own),
2. ``<control>class.cri-resource-manager.intel.com/pod``,
3. the controller's ``defaults[<QoS class>]``.

This is the ancestor's annotation scheme (its issue "Default blockio/RDT class from pod/container
annotations"), so pods written for it keep working.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DOMAIN = "cri-resource-manager.intel.com"


def annotation_key(control: str, scope: str) -> str:
    """``annotation_key("blockio", "pod")`` -> ``blockioclass.cri-resource-manager.intel.com/pod``."""
    return f"{control}class.{DOMAIN}/{scope}"


@dataclass(frozen=True)
class Resolved:
    cls: str | None  # None: the container gets no class from this control
    source: str  # the annotation key, "defaults.<QoS>", or "" when none applies


def resolve_class(control: str, container: str, annotations: Mapping[str, str], qos_class: str,
                  defaults: Mapping[str, str]) -> Resolved:
    for key in (annotation_key(control, f"container.{container}"), annotation_key(control, "pod")):
        value = annotations.get(key)
        if value is not None and value.strip():
            return Resolved(value.strip(), key)
    if qos_class in defaults:
        return Resolved(defaults[qos_class], f"defaults.{qos_class}")
    return Resolved(None, "")
