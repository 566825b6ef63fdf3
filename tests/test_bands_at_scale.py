"""The bands-at-scale benchmark (``benchmarks/bands_at_scale.py``) on one scenario: sharding the
buffers over more ranks never lowers b, never raises the expected error, and reaches b > 1 where
rank 0 alone could not hold two bands."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bands_at_scale.py"


def test_sharding_the_buffers_lets_large_models_have_more_bands() -> None:
    spec = importlib.util.spec_from_file_location("bands_at_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.rows(100_000, 1024, 3, 8.0)
    for _model, ranks, b_before, e_before, b_after, e_after, _b_free, e_free in rows:
        assert b_after >= b_before and e_after <= e_before + 1e-12 and e_free <= e_after + 1e-12
        if ranks == 1:
            assert (b_after, e_after) == (b_before, e_before)  # one rank: nothing to share
    by_key = {(m, r): (b0, b1) for m, r, b0, _, b1, *_ in rows}
    assert by_key[("500M", 1)] == (1, 1) and by_key[("500M", 8)][1] > 1
