"""Who hurts whom: the containers a move separates, in the sense of CPI2 (Zhang et al., "CPI²: CPU
performance isolation for shared compute clusters", EuroSys 2013): a *victim* whose slowdown signal
the model predicts, and an *antagonist* whose usage predicts it.

Every pair term of the cost model splits its cost over (antagonist, victim) pairs
(:meth:`.terms.CostTerm.inflicted`): for AVX512 × sensitive work the product of the AVX512 load and
the sensitive load per shared core or package; for the capacity terms (CPU, memory bandwidth, cache)
the excess of a domain over its capacity, split by the two containers' shares of the domain's load.
The separation of a move is the interference between the moved container and each other container
before the round, less after it; the largest are reported with the antagonist's usage in the term's
own unit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel

from .model import CostModel
from .problem import ATTR_NAMES, Problem

MAX_PAIRS = 3  # separations reported per move


class Separation(BaseModel):
    term: str
    victim: str  # container id
    antagonist: str  # container id
    # The victim's slowdown predicted from this antagonist (cost units per second, both directions of
    # the pair for the capacity terms), before the round and after it.
    interference_before: float
    interference_after: float
    predicted_gain: float  # (before − after) × amortization_seconds
    antagonist_usage: float  # in the unit of ``usage``
    usage: str  # what the antagonist's usage is, e.g. "avx512_load" (CPUs), "memory_bandwidth_bytes_per_second"


def separations(prob: Problem, model: CostModel, after: np.ndarray, moved: list[int]) -> dict[int, list[Separation]]:
    """For each moved container index, the pairs whose interference the round lowers most."""
    out: dict[int, list[Separation]] = {i: [] for i in moved}
    if not moved:
        return out
    rows = np.array(moved, dtype=np.int64)
    H = prob.cfg.amortization_seconds
    found: dict[int, list[tuple[float, Separation]]] = {i: [] for i in moved}
    for t in model.active_terms(prob):
        before = t.inflicted(prob, prob.S0, rows)
        if before is None or t.usage_attr is None:
            continue
        now = t.inflicted(prob, after, rows)
        assert now is not None
        out_b, in_b = before
        out_a, in_a = now
        usage = prob.X[:, t.usage_attr]
        for k, i in enumerate(moved):
            pair_b = out_b[k] + in_b[k]
            pair_a = out_a[k] + in_a[k]
            pair_b[i] = pair_a[i] = 0.0  # a container is not its own antagonist
            gain = pair_b - pair_a
            for j in np.argsort(-gain, kind="stable")[:MAX_PAIRS]:
                if gain[j] <= 1e-12:
                    break
                j = int(j)
                # A directed term: who inflicts the larger part; a capacity term: the heavier user.
                directed = out_b[k][j] != in_b[k][j]
                i_hurts = out_b[k][j] > in_b[k][j] if directed else usage[i] >= usage[j]
                ant, vic = (i, j) if i_hurts else (j, i)
                found[i].append((float(gain[j]), Separation(
                    term=t.name, victim=prob.containers[vic].id, antagonist=prob.containers[ant].id,
                    interference_before=float(pair_b[j]), interference_after=float(pair_a[j]),
                    predicted_gain=float(gain[j]) * H, antagonist_usage=float(usage[ant]),
                    usage=ATTR_NAMES[t.usage_attr])))
    for i, lst in found.items():
        lst.sort(key=lambda gs: -gs[0])
        out[i] = [s for _, s in lst[:MAX_PAIRS]]
    return out


@dataclass(frozen=True)
class Explanation:
    """What a move record carries besides its reason (the relay's MoveRecord fields of the same names)."""

    gain_by_term: dict[str, float] = field(default_factory=dict)
    separates: list[dict[str, str | float]] = field(default_factory=list)

    @classmethod
    def of(cls, gain_by_term: dict[str, float], pairs: list[Separation]) -> Explanation:
        return cls(dict(gain_by_term), [p.model_dump() for p in pairs])


def move_why(reason: str, pairs: list[Separation]) -> str:
    """A move's reason with the pairs it separates, as one line for the relay's move record (``why``)."""
    if not pairs:
        return reason
    sep = ", ".join(f"victim {p.victim} from antagonist {p.antagonist} ({p.term}, gain {p.predicted_gain:.3g})"
                    for p in pairs)
    return f"{reason}; separates {sep}"
