"""bench/scale_bench.py's default warm-up: long enough for the RDT rotation to give every container its turn."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from scale_bench import warmup_for

from cri_resmgr.config import RdtCollectorConfig


def test_warmup_covers_one_full_rotation_at_the_agents_defaults():
    cfg = RdtCollectorConfig()
    assert (cfg.rotation_share, cfg.rotation_slice_seconds) == (0.25, 10.0)  # the figures below assume these
    # 1,000 containers, 256 RMIDs: 192 keep theirs, 808 rotate through 64 slots, 13 slices of 10 s
    assert warmup_for(1000, 256, None) == 15.0 + 13 * 10.0
    assert warmup_for(200, 256, None) == 15.0  # a group each: nothing rotates
    assert warmup_for(300, 256, 30.0) == 15.0 + 2 * 30.0  # a collector interval past the slice: a slice a run
