"""AdaCliP's option set declared once (:mod:`adaclip.options`) and the noise-drift gate.

``AdaptiveOptions`` names exactly the keywords ``adaptive_clipping`` reads (every field of
``AdaptiveClipping`` plus the builder's own), ``strategy_from_kwargs`` splits a wrapper's
keywords and builds the same strategy as ``adaptive_clipping`` (raising the same errors),
``depends_on_num_params`` says when the strategy follows ``d``, and
``strategy.noise_drift_applies()`` is the gate the wrappers tested with ``isinstance``.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from adaclip import adaptive, options
from adaclip import strategies as S
from adaclip.errors import InvalidHyperparameterError, NoiseDominatedWarning


def test_the_option_set_is_the_class_fields_and_the_builders_keywords():
    fields = {f.name for f in dataclasses.fields(S.AdaptiveClipping)}
    builder_only = {"preset", "initial_max_grad_norm", "std_spread"}
    assert set(options.ADAPTIVE_OPTION_NAMES) == fields | builder_only
    doc = options.AdaptiveOptions.__doc__
    for name in options.ADAPTIVE_OPTION_NAMES:
        assert f"  {name}: " in doc, name


def test_strategy_from_kwargs_splits_and_builds():
    kwargs = {"pooling": "factored", "beta_std": 0.99, "lr": 0.1, "noise_multiplier": 1.0, "centre": None}
    strategy, rest = S.strategy_from_kwargs(100, kwargs)
    assert strategy == S.adaptive_clipping(100, pooling="factored", beta_std=0.99)
    assert rest == {"lr": 0.1, "noise_multiplier": 1.0}
    with pytest.raises(InvalidHyperparameterError, match="scale='coupled' is the patent's scale"):
        S.strategy_from_kwargs(100, {"scale": "coupled"})
    with pytest.raises(InvalidHyperparameterError, match="preset must be one of"):
        S.adaptive_clipping(100, preset=None)


@pytest.mark.parametrize(
    ("opts", "depends"),
    [
        ({}, True),
        ({"std_min": 1e-3, "std_max": 1.0}, False),
        ({"preset": "patent"}, False),
        ({"preset": "patent", "initial_max_grad_norm": 0.5}, True),
    ],
)
def test_depends_on_num_params(opts, depends):
    assert S.depends_on_num_params(opts, S.adaptive_clipping(1, **opts)) is depends


def test_the_noise_drift_gate_is_the_coupled_scale():
    assert S.AdaptiveClipping().noise_drift_applies()
    assert not S.adaptive_clipping(10).noise_drift_applies()
    for strategy in (S.FlatClipping(1.0), S.QuantileClipping(), S.AutomaticClipping(), S.ScaledClipping(1.0, (1.0,))):
        assert not strategy.noise_drift_applies()
    d = 10_000
    with pytest.warns(NoiseDominatedWarning):
        assert adaptive.warn_of_noise_drift(S.AdaptiveClipping(), d, 4.0, 8.0) > 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert adaptive.warn_of_noise_drift(S.adaptive_clipping(d), d, 4.0, 8.0) is None
        assert adaptive.warn_of_noise_drift(object(), d, 4.0, 8.0) is None  # a strategy without the method


def test_finite_positive_is_the_one_number_check_and_refuses_a_bool():
    # one check for every front end (the Flower aggregation had its own copy, which refused a
    # bool while the core's read True as 1.0)
    assert options.finite_positive("x", 2) == 2.0
    assert options.finite_positive("x", 0.0, allow_zero=True) == 0.0
    for bad in (True, False, "1", float("nan"), float("inf"), -1.0, 0.0, None):
        with pytest.raises(InvalidHyperparameterError, match="^x must be"):
            options.finite_positive("x", bad)
    pytest.importorskip("flwr")
    from adaclip_flower import aggregation

    assert not hasattr(aggregation, "_finite_positive")
    assert aggregation.finite_positive is options.finite_positive


def test_the_audit_modules_count_with_the_one_integer_check():
    # the audit estimators, the Pareto-tail test and the input canaries had three copies of an
    # integer check; now one, whose error is an InvalidHyperparameterError (still a ValueError,
    # as they raised before)
    import numpy as np

    from adaclip.audit import draw_inclusion, estimators, hill_estimator, input_canaries, pareto

    for module in (estimators, input_canaries, pareto):
        assert not hasattr(module, "_count") and not hasattr(module, "_int")
        assert module.integer_at_least is options.integer_at_least
    assert options.integer_at_least("k", np.int64(3), 1) == 3
    for bad in (True, np.True_, 2.0, "3", 0):
        with pytest.raises(InvalidHyperparameterError, match=r"^k must be an integer >= 1, got"):
            options.integer_at_least("k", bad, 1)
    with pytest.raises(ValueError, match=r"^k must be an integer >= 1, got 0"):
        hill_estimator(np.arange(1.0, 10.0), k=0)
    with pytest.raises(ValueError, match=r"^num_canaries must be an integer >= 0, got -1"):
        draw_inclusion(-1, seed=0)


def test_no_module_keeps_its_own_copy_of_the_number_checks():
    # the NumPy reference, the ledger, the banded planning and make_private had their own
    # positive-number and integer checks; they call the ones in adaclip.options
    from adaclip import ledger, reference
    from adaclip.correlated import planning

    assert not hasattr(reference, "_check_positive") and reference.finite_positive is options.finite_positive
    assert not hasattr(ledger, "_count") and ledger.integer_at_least is options.integer_at_least
    assert not hasattr(planning, "_non_negative_int") and planning.integer_at_least is options.integer_at_least
    with pytest.raises(InvalidHyperparameterError, match="^noise_multiplier must be a number, got True"):
        reference.split_noise_multiplier(True, 5.0)  # a bool is not a noise multiplier (it was read as 1)
