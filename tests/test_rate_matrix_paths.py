"""rate_matrix's gap-free fast path gives what the general (gap-aware) path gives."""

import numpy as np

from cri_resmgr.store.query import rate_matrix, step_times


def test_gap_free_fast_path_equals_general_path():
    rng = np.random.default_rng(3)
    ts = np.cumsum(rng.uniform(0.5, 1.5, 400)) + 1000.0
    V = np.cumsum(rng.random((400, 6)) * 10, axis=0)
    V[200:, 2] -= V[200, 2] - 1.0  # a counter reset in one column
    times = step_times(ts[0], ts[-1], 7.0)
    fast = rate_matrix(ts, V, times, 7.0)
    with_gap = np.column_stack([V, np.full(len(ts), np.nan)])  # an all-NaN column forces the general path
    with_gap[5, 6] = 1.0
    general = rate_matrix(ts, with_gap, times, 7.0)[:, :6]
    assert np.isnan(general).sum() == np.isnan(fast).sum()
    assert np.allclose(fast, general, equal_nan=True)
    assert np.nanmin(fast) >= 0  # the reset did not make a negative rate
