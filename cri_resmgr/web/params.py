"""Query parameters the API's handlers share, each read one way: ``match[]`` label matchers and the metric name."""

from __future__ import annotations

from collections.abc import Iterable

from .. import metrics as M
from ..store import Matcher, QueryError, Store, parse_matchers


def matchers_of(match: Iterable[str]) -> list[Matcher]:
    """Every ``match[]`` value's matchers, all of which must hold (as in Prometheus' series API)."""
    out: list[Matcher] = []
    for m in match:
        out += parse_matchers(m)
    return out


def require_known_metric(store: Store, metric: str, listing: str) -> None:
    """A metric the store holds or metrics.py declares; any other name is a 400 that says where the stored ones
    are listed (``listing``, an API path)."""
    if not store.has_metric(metric) and M.lookup(metric) is None:
        raise QueryError(f"unknown metric {metric!r}; see {listing} for the stored ones")
