"""The bands-at-scale benchmark (``benchmarks/bands_at_scale.py``) on one scenario: sharding the
buffers over more ranks never lowers b, never raises the expected error, and reaches b > 1 where
rank 0 alone could not hold two bands; BLT's m buffers fit the budget where they are offered."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bands_at_scale.py"


def test_sharding_the_buffers_lets_large_models_have_more_bands() -> None:
    spec = importlib.util.spec_from_file_location("bands_at_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # RDP and m ≤ 2 for the BLT column: the PLD calibration of its blocks takes ~25 s each
    rows = module.rows(100_000, 1024, 3, 8.0, blt_buffers=(1, 2), blt_accountant="rdp")
    sizes = dict(module.MODELS)
    for model, ranks, b_before, e_before, b_after, e_after, m, e_blt, _b_free, e_free in rows:
        assert b_after >= b_before and e_after <= e_before + 1e-12 and e_free <= e_after + 1e-12
        if ranks == 1:
            assert (b_after, e_after) == (b_before, e_before)  # one rank: nothing to share
        fits = 1 * -(-4 * sizes[model] // ranks) <= module.BANDED_BUFFER_BUDGET_BYTES
        assert (m is not None) == fits  # offered exactly where one buffer fits
        if m is not None:
            assert m * -(-4 * sizes[model] // ranks) <= module.BANDED_BUFFER_BUDGET_BYTES
            assert 0 < e_blt < 1  # at ε = 8 BLT's error is below DP-SGD's
    by_key = {(m, r): (b0, b1) for m, r, b0, _, b1, *_ in rows}
    assert by_key[("500M", 1)] == (1, 1) and by_key[("500M", 8)][1] > 1


def test_the_dense_momentum_error_is_the_banded_one_on_banded_coefficients() -> None:
    """The BLT column's error formula (a convolution) equals the library's on banded factors."""
    import numpy as np

    from adaclip.correlated.coefficients import _impulse_response, expected_error, sqrt_toeplitz_coefficients

    spec = importlib.util.spec_from_file_location("bands_at_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for b in (1, 4, 16):
        c = sqrt_toeplitz_coefficients(b)
        want = expected_error(c, 300, workload="momentum", momentum=0.9)
        assert abs(module.momentum_error(_impulse_response(np.asarray(c), 300), 300) - want) < 1e-9 * want
