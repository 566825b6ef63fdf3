"""White-box canary audits of the real optimizers against the accountant: the empirical ε stays below it.

For PyTorch (``AdaClip``, ``FlatClip``; the hooks path ``per_sample_mode="materialise"`` and
the ghost path ``"ghost"``) and JAX (``adaclip_jax.adaclip``, ``flat_clip``):

* the empirical ε of a strong white-box audit stays below the accountant's ε: the lower
  confidence bound (99.9 %) of the Gaussian-DP fit, and the assumption-free threshold bound,
  are at most the ε that ``Accountant("pld")`` gives for the audited step;
* a deliberately broken mechanism is detected: the optimizer built with ``σ/2`` (or with no
  noise at all) while the accountant is told ``σ`` gives an ε lower bound *above* the
  accountant's ε;
* the audit is strong, not vacuous: the point estimate of ``μ`` is consistent with the
  accountant's ``μ = 1/σ`` from below (the canary really moves the release by the whole
  sensitivity), so a passing audit is evidence and not an artefact of a weak canary.

How a trial works, why every trial is a draw of the same one-step Gaussian mechanism
(``μ = 1/σ`` GDP, whatever the AdaCliP state), and the two estimators: see the docstring of
``tests/_privacy_audit.py``. Every test uses fixed seeds, so it is deterministic. At 99.9 %
confidence (each of the two bounds) a *correct* mechanism fails a given audit for one or two
seeds in a thousand; the ``σ/2`` controls are detected by margins of about 10 standard errors.

The default run holds the fast versions (500–2 000 trials, one to three seconds each). The strong
versions (3 000–6 000 trials, every combination, each with its ``σ/2`` control on a third as
many trials) are marked ``slow`` (a few minutes together on 2 cores):
``python -m pytest -m slow tests/test_privacy_audit.py``.

The adaptive options and the other adaptive strategies (separated scale with the quantile rule,
factored unbiased delayed statistics, the Kalman centre, automatic clipping, quantile clipping)
are audited on the core's ``private_step`` and on both frameworks' generic paths
(``DPOptimizer(strategy=...)``, ``adaclip_jax.private_aggregate``). With the quantile rule the
step also releases a count of unclipped units; the score combines it with the gradient (see
``_privacy_audit.core_trials``), so a leak through the count shows: a control that keeps the
gradient's full σ although the count is released too (μ = 2.6 instead of 2; 2.25 for the
score, which weighs the releases for the claimed σ) is detected.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

pytest.importorskip("scipy")

import _privacy_audit as pa  # noqa: E402

from adaclip import strategies as S  # noqa: E402

#: σ of the audited optimizers: μ = 2, accountant ε = 9.997 at δ = 1e-5; the σ/2 control has μ = 4.
#: A small σ makes the audit most sensitive to a canary contributing more than the sensitivity:
#: an excess Δ shifts μ by Δ/σ, so a 30 % under-clip is seen with ~500 trials at σ = 0.5 and
#: ~4 000 at σ = 2.
SIGMA = 0.5
#: The σ the accountant is told when the optimizer adds no noise at all: the assumption-free
#: threshold test can certify ε ≈ 3 with 500 trials, above this σ's ε = 1.993 but not σ = 0.5's.
NO_NOISE_CLAIM = 2.0
FAST = 1000
STRONG = 6000
TORCH_CASES = [(s, m) for s in ("adaclip", "flat") for m in ("materialise", "ghost")]
#: z of the tightness check (μ̂ not significantly below 1/σ: the audit is not vacuous)
TIGHT_Z = 4.5


def _audit(framework: str, name: str, claimed_sigma: float = SIGMA, **kwargs) -> pa.Audit:
    """Run the trials of ``framework`` ("torch", "jax" or "core") and analyse them against
    ``claimed_sigma`` (which also weights the count in the score of a strategy object)."""
    modules = {"torch": ("torch",), "jax": ("jax", "optax"), "core": ()}[framework]
    for module in modules:
        pytest.importorskip(module)
    trials = {"torch": pa.torch_trials, "jax": pa.jax_trials, "core": pa.core_trials}[framework]
    if not isinstance(kwargs["strategy"], str):
        kwargs["claimed_sigma"] = claimed_sigma
    start = time.perf_counter()
    scores, included, reported = trials(seed=pa.seed_for(name), **kwargs)
    assert reported == kwargs["noise_multiplier"], f"{framework}: the σ recorded is not the σ used"
    audit = pa.analyse(name, scores, included, claimed_sigma, seconds=time.perf_counter() - start)
    print(audit.summary())
    return audit


def _torch(name: str, claimed_sigma: float = SIGMA, **kwargs) -> pa.Audit:
    return _audit("torch", name, claimed_sigma, **kwargs)


def _jax(name: str, claimed_sigma: float = SIGMA, **kwargs) -> pa.Audit:
    return _audit("jax", name, claimed_sigma, **kwargs)


def _core(name: str, claimed_sigma: float = SIGMA, **kwargs) -> pa.Audit:
    return _audit("core", name, claimed_sigma, **kwargs)


# --------------------------------------------------------------------------- the adaptive options


#: B̄ of every audit
AUDIT_BATCH = 4.0
#: The quantile rule of the audited strategies. σ_b = 0.3 at σ = 0.5 puts most of the step's
#: μ² = 4 in the count (¼/σ_b² = 2.78, 1/σ_g² = 1.22), so a leak through the count shows. The
#: target ½ − 1/(4B̄) is the audit's average released fraction (the canary, clipped, is in half
#: the trials), so C_t does not drift over thousands of trials (see pa.core_trials).
AUDIT_RULE = S.QuantileRule(target_quantile=0.5 - 1 / (4 * AUDIT_BATCH), learning_rate=0.2, count_noise_multiplier=0.3)


def new_strategy(name: str, dim: int):
    """The audited strategy ``name`` for ``dim`` coordinates (initial clip norm 1)."""
    s0 = 1.0 / dim**0.5
    if name == "separated+quantile":
        return S.AdaptiveClipping(s0 / 30, s0 * 30, scale="separated", max_grad_norm=1.0, quantile=AUDIT_RULE)
    if name == "factored+unbiased+delayed":
        return S.AdaptiveClipping.from_initial_clip(1.0, dim, pooling="factored", correction="unbiased", update_every=3)
    if name == "kalman":
        return S.AdaptiveClipping.from_initial_clip(1.0, dim, centre="kalman", process_noise=0.1)
    if name == "automatic":
        return S.AutomaticClipping(max_grad_norm=1.0)
    if name == "quantile":
        return S.QuantileClipping(max_grad_norm=1.0, quantile=AUDIT_RULE)
    raise ValueError(name)


NEW_OPTIONS = ["separated+quantile", "factored+unbiased+delayed", "kalman", "automatic", "quantile"]
CORE_DIM = 4 * 6 + 6 + 2 * 3 * 2  # core_trials' default shapes
TORCH_DIM = 32  # torch_trials' default nn.Linear(32, 1)
JAX_DIM = 4 * 6 + 6 + 2  # jax_trials' default shapes


class UnsplitQuantileClipping(S.QuantileClipping):
    """BROKEN on purpose: releases the count with ``σ_b`` but keeps the gradient's full σ
    instead of ``σ_g``, so the step is μ-GDP with ``μ = √(1/σ² + ¼/σ_b²)`` (2.6 at σ = 0.5,
    σ_b = 0.3) while the accountant records σ (μ = 2). The audit's score, weighted for the
    claimed σ, sees ``μ = 1/sd = 2.25``."""

    def noise_multipliers(self, noise_multiplier, expected_batch_size):
        return noise_multiplier, self.quantile.count_noise(expected_batch_size)


UNSPLIT = UnsplitQuantileClipping(max_grad_norm=1.0, quantile=AUDIT_RULE)


def half_noise(strategy):
    """The strategy of the σ/2 control: with the quantile rule, its count noise σ_b halved too
    (σ_b is a hyperparameter of its own, and here carries most of μ²), so that every part of
    the release has half the claimed noise (μ = 4)."""
    rule = getattr(strategy, "quantile", None)
    if rule is None:
        return strategy
    return dataclasses.replace(strategy, quantile=dataclasses.replace(rule, count_noise_multiplier=rule.count_noise_multiplier / 2))


def control(strategy) -> dict:
    """Keyword arguments of the σ/2 control of ``strategy`` (scored for the claimed strategy)."""
    return dict(strategy=half_noise(strategy), claimed_strategy=strategy, noise_multiplier=SIGMA / 2)


def assert_within_accountant(audit: pa.Audit) -> None:
    """The contract: no empirical ε lower bound above the accountant's ε."""
    assert audit.gdp.epsilon_lower <= audit.accountant_epsilon, (
        "privacy violation detected (GDP fit): " + audit.summary()
    )
    assert audit.threshold.epsilon_lower <= audit.accountant_epsilon, (
        "privacy violation detected (threshold test): " + audit.summary()
    )


def assert_tight(audit: pa.Audit) -> None:
    """The audit is strong: μ̂ is not significantly below the accountant's μ = 1/σ (a canary
    that lost part of its effect, e.g. over-clipped or partly dropped, would make the audit
    weak, and a pass meaningless)."""
    assert audit.gdp.mu >= 1 / audit.claimed_sigma - TIGHT_Z * audit.gdp.se, (
        "the canary moved the release by less than its sensitivity (weak audit): " + audit.summary()
    )


def assert_detected(audit: pa.Audit, *, by: str = "gdp") -> None:
    """A broken mechanism: the empirical ε lower bound is above the accountant's ε."""
    bound = audit.gdp.epsilon_lower if by == "gdp" else audit.threshold.epsilon_lower
    assert bound > audit.accountant_epsilon, f"broken mechanism NOT detected ({by}): " + audit.summary()


# --------------------------------------------------------------------------- the estimators


def test_gdp_conversion_matches_the_accountant_for_a_gaussian_step():
    for sigma in (0.5, 1.0, 2.0):
        assert pa.gdp_epsilon(1 / sigma) == pytest.approx(pa.accountant_epsilon(sigma), rel=1e-6)
    assert pa.gdp_epsilon(0.0) == 0.0 and pa.gdp_epsilon(float("inf")) == float("inf")


def test_estimators_on_simulated_gaussian_scores():
    """The estimators on exact N(0, σ²)/N(μσ, σ²) draws: a correct mechanism is not flagged, a
    twice-too-weak one is, and the threshold bound is valid but weaker."""
    import numpy as np

    rng = np.random.default_rng(0)
    included = rng.random(FAST) < 0.5
    z = rng.standard_normal(FAST)
    good = pa.analyse("simulated σ", included + SIGMA * z, included, SIGMA)
    bad = pa.analyse("simulated σ/2", included + SIGMA / 2 * z, included, SIGMA)
    assert_within_accountant(good)
    assert_tight(good)
    assert_detected(bad)
    assert bad.threshold.epsilon_lower < bad.gdp.epsilon_lower
    exact = pa.analyse("simulated σ=0", included.astype(float), included, NO_NOISE_CLAIM)
    assert_detected(exact, by="threshold")


# --------------------------------------------------------------------------- fast audits


@pytest.mark.torch
@pytest.mark.parametrize("strategy, mode", TORCH_CASES)
def test_torch_audit_within_accountant(strategy, mode):
    audit = _torch(f"torch {strategy} {mode}", strategy=strategy, per_sample_mode=mode,
                   noise_multiplier=SIGMA, trials=FAST)  # fmt: skip
    assert_within_accountant(audit)
    assert_tight(audit)


@pytest.mark.torch
@pytest.mark.parametrize("strategy, mode", TORCH_CASES)
def test_torch_half_sigma_is_detected(strategy, mode):
    audit = _torch(f"torch {strategy} {mode} σ/2", strategy=strategy, per_sample_mode=mode,
                   noise_multiplier=SIGMA / 2, trials=FAST)  # fmt: skip
    assert_detected(audit)


@pytest.mark.torch
def test_torch_empty_batch_step_is_the_empty_world():
    """World 0 by ``step(empty_batch=True)`` instead of a zero-length backward."""
    audit = _torch("torch adaclip ghost empty_batch", strategy="adaclip", per_sample_mode="ghost",
                   noise_multiplier=SIGMA, trials=FAST, empty_world="empty_batch")  # fmt: skip
    assert_within_accountant(audit)
    assert_tight(audit)


@pytest.mark.torch
@pytest.mark.parametrize("mode", ["materialise", "ghost"])
def test_torch_no_noise_is_detected_without_assumptions(mode):
    """σ = 0 while the accountant is told σ = 2: the threshold test (no Gaussian assumption)
    alone certifies an ε above the accountant's."""
    audit = _torch(f"torch flat {mode} no noise", NO_NOISE_CLAIM, strategy="flat", per_sample_mode=mode,
                   noise_multiplier=0.0, trials=500)  # fmt: skip
    assert_detected(audit, by="threshold")
    assert_detected(audit)


@pytest.mark.torch
@pytest.mark.parametrize("mode", ["materialise", "ghost"])
def test_torch_nan_canary_is_indistinguishable_from_absence(mode):
    """A unit whose gradient has a NaN entry contributes nothing (``nonfinite="zero"``): the
    release stays finite and no audit tells it from an empty batch (``μ`` consistent with 0)."""
    audit = _torch(f"torch adaclip {mode} NaN canary", strategy="adaclip", per_sample_mode=mode,
                   noise_multiplier=SIGMA, trials=FAST, canary="nan")  # fmt: skip
    assert_within_accountant(audit)
    assert audit.gdp.mu_lower <= 0.0, "the NaN unit's presence is visible: " + audit.summary()


@pytest.mark.torch
def test_torch_adaclip_ghost_loaded_state_with_large_centre():
    """AdaCliP state loaded with ``‖m/b‖ = 10⁴`` (``s = std_min``) on the ghost path, where the
    expanded norm ``Σ D g² − 2 Σ D m g + Σ D m²`` cancels in float32; the canary has ``‖w‖ = 3``,
    the norm the cancellation hid before the ghost norms became upper bounds (at commit
    ``298f393~1`` such canaries contributed 0.8 to 3 times the sensitivity, about 1.2 to 1.6 on
    average, and this audit measured μ̂ ≈ 2.3–3.2 for the accountant's μ = 2). The contract must
    hold there too. The state is reloaded before every trial (keeping the current noise
    generator state, so nothing replays): the statistics would otherwise move away from it."""
    audit = _torch("torch adaclip ghost ‖m/b‖=1e4", strategy="adaclip", per_sample_mode="ghost",
                   noise_multiplier=SIGMA, trials=2 * FAST, dim=64, loaded_ratio=1e4, canary_norm=3.0)  # fmt: skip
    assert_within_accountant(audit)
    assert_tight(audit)


@pytest.mark.jax
@pytest.mark.parametrize("strategy", ["adaclip", "flat"])
def test_jax_audit_within_accountant(strategy):
    audit = _jax(f"jax {strategy} mask", strategy=strategy, noise_multiplier=SIGMA, trials=FAST)
    assert_within_accountant(audit)
    assert_tight(audit)


@pytest.mark.jax
@pytest.mark.parametrize("strategy", ["adaclip", "flat"])
def test_jax_half_sigma_is_detected(strategy):
    audit = _jax(f"jax {strategy} mask σ/2", strategy=strategy, noise_multiplier=SIGMA / 2, trials=FAST)
    assert_detected(audit)


@pytest.mark.jax
def test_jax_no_noise_is_detected_without_assumptions():
    audit = _jax("jax adaclip no noise", NO_NOISE_CLAIM, strategy="adaclip", noise_multiplier=0.0, trials=500)
    assert_detected(audit, by="threshold")
    assert_detected(audit)


@pytest.mark.jax
def test_jax_nan_canary_is_indistinguishable_from_absence():
    audit = _jax(
        "jax adaclip NaN canary", strategy="adaclip", noise_multiplier=SIGMA, trials=FAST, canary="nan"
    )
    assert_within_accountant(audit)
    assert audit.gdp.mu_lower <= 0.0, "the NaN unit's presence is visible: " + audit.summary()


@pytest.mark.parametrize("name", NEW_OPTIONS)
def test_core_audit_of_the_adaptive_options_within_accountant(name):
    audit = _core(f"core {name}", strategy=new_strategy(name, CORE_DIM), noise_multiplier=SIGMA, trials=FAST)
    assert_within_accountant(audit)
    assert_tight(audit)


def test_core_audit_detects_an_unsplit_count_release():
    """The count released beside a gradient that kept its full σ: the pair leaks more than σ
    and the audit, which scores the count too, sees it. (The score weighs the releases for the
    claimed σ, not for the broken mechanism: its μ is then 2.25 rather than the optimal 2.6,
    hence 4 000 trials.)"""
    audit = _core("core quantile unsplit σ", strategy=UNSPLIT, noise_multiplier=SIGMA, trials=4 * FAST)
    assert_detected(audit)


@pytest.mark.torch
def test_torch_audit_of_quantile_clipping_ghost():
    audit = _torch("torch quantile ghost", strategy=new_strategy("separated+quantile", TORCH_DIM),
                   per_sample_mode="ghost", noise_multiplier=SIGMA, trials=FAST)  # fmt: skip
    assert_within_accountant(audit)
    assert_tight(audit)


@pytest.mark.jax
def test_jax_audit_of_quantile_clipping_mask():
    """Masked rows (all copies of the canary) must add nothing to the count either."""
    audit = _jax("jax quantile mask", strategy=new_strategy("quantile", JAX_DIM), noise_multiplier=SIGMA,
                 trials=FAST // 2)  # fmt: skip
    assert_within_accountant(audit)
    assert_tight(audit)


# --------------------------------------------------------------------------- strong audits


#: (strategy, path, world 0, trials): every strategy × path with the zero-length batch, and
#: AdaCliP's ``step(empty_batch=True)`` world with fewer trials.
STRONG_TORCH = [(s, m, "zero_length", STRONG) for s, m in TORCH_CASES] + [
    ("adaclip", m, "empty_batch", STRONG // 2) for m in ("materialise", "ghost")
]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("strategy, mode, empty_world, trials", STRONG_TORCH)
def test_torch_strong_audit(strategy, mode, empty_world, trials):
    name = f"strong torch {strategy} {mode} {empty_world}"
    kwargs = dict(strategy=strategy, per_sample_mode=mode, empty_world=empty_world)
    audit = _torch(name, noise_multiplier=SIGMA, trials=trials, **kwargs)
    assert_within_accountant(audit)
    assert_tight(audit)
    assert_detected(_torch(name + " σ/2", noise_multiplier=SIGMA / 2, trials=trials // 3, **kwargs))


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("mode", ["materialise", "ghost"])
def test_torch_strong_audit_loaded_state_with_large_centre(mode):
    """As :func:`test_torch_adaclip_ghost_loaded_state_with_large_centre`, with more trials, on
    both paths, and with its σ/2 control."""
    name = f"strong torch adaclip {mode} ‖m/b‖=1e4"
    kwargs = dict(strategy="adaclip", per_sample_mode=mode, dim=64, loaded_ratio=1e4, canary_norm=3.0)
    audit = _torch(name, noise_multiplier=SIGMA, trials=STRONG // 2, **kwargs)
    assert_within_accountant(audit)
    assert_tight(audit)
    assert_detected(_torch(name + " σ/2", noise_multiplier=SIGMA / 2, trials=STRONG // 6, **kwargs))


#: (strategy, world 0, trials): the padded, masked batch for both strategies, and the leading
#: axis of 0 with fewer trials.
STRONG_JAX = [(s, "mask", STRONG) for s in ("adaclip", "flat")] + [
    (s, "empty", STRONG // 2) for s in ("adaclip", "flat")
]


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.parametrize("strategy, empty_world, trials", STRONG_JAX)
def test_jax_strong_audit(strategy, empty_world, trials):
    name = f"strong jax {strategy} {empty_world}"
    audit = _jax(name, strategy=strategy, noise_multiplier=SIGMA, trials=trials, empty_world=empty_world)
    assert_within_accountant(audit)
    assert_tight(audit)
    control = _jax(name + " σ/2", strategy=strategy, noise_multiplier=SIGMA / 2, trials=trials // 3,
                   empty_world=empty_world)  # fmt: skip
    assert_detected(control)


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW_OPTIONS)
def test_core_strong_audit_of_the_adaptive_options(name):
    strategy = new_strategy(name, CORE_DIM)
    audit = _core(f"strong core {name}", strategy=strategy, noise_multiplier=SIGMA, trials=STRONG)
    assert_within_accountant(audit)
    assert_tight(audit)
    assert_detected(_core(f"strong core {name} σ/2", trials=STRONG // 3, **control(strategy)))


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("mode", ["materialise", "ghost"])
@pytest.mark.parametrize("name", NEW_OPTIONS)
def test_torch_strong_audit_of_the_adaptive_options(name, mode):
    strategy = new_strategy(name, TORCH_DIM)
    audit = _torch(f"strong torch {name} {mode}", strategy=strategy, per_sample_mode=mode, noise_multiplier=SIGMA,
                   trials=STRONG // 2)  # fmt: skip
    assert_within_accountant(audit)
    assert_tight(audit)
    assert_detected(_torch(f"strong torch {name} {mode} σ/2", per_sample_mode=mode, trials=STRONG // 6,
                           **control(strategy)))  # fmt: skip


@pytest.mark.slow
@pytest.mark.jax
@pytest.mark.parametrize("name", NEW_OPTIONS)
def test_jax_strong_audit_of_the_adaptive_options(name):
    strategy = new_strategy(name, JAX_DIM)
    audit = _jax(f"strong jax {name} mask", strategy=strategy, noise_multiplier=SIGMA, trials=STRONG // 3)
    assert_within_accountant(audit)
    assert_tight(audit)
    assert_detected(_jax(f"strong jax {name} mask σ/2", trials=STRONG // 9, **control(strategy)))


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["core", "torch"])
def test_strong_audit_detects_an_unsplit_count_release(framework):
    kwargs = dict(per_sample_mode="ghost") if framework == "torch" else {}
    audit = _audit(framework, f"strong {framework} quantile unsplit σ", strategy=UNSPLIT, noise_multiplier=SIGMA,
                   trials=STRONG, **kwargs)  # fmt: skip
    assert_detected(audit)
