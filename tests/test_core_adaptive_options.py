"""The adaptive options of the core (adaclip.adaptive, adaclip.strategies) against the reference.

Every option of :class:`AdaptiveClipping` (centre, statistic, correction, pooling, delay, scale,
quantile rule, frozen or public statistics), :class:`QuantileClipping` and
:class:`AutomaticClipping`: the core's ``private_step`` on NumPy float64 arrays split into
several tensors (a matrix, a vector, a 3-d tensor, a scalar) equals the flat reference
(:mod:`adaclip.reference`, written from the maths) on the same injected noise, release and
state alike, step after step; the state is a function of the releases only; the parts have the
properties the maths gives them (the Kalman gain's fixed point, the debiased centre, what the
delayed statistics target); bad hyperparameters raise InvalidHyperparameterError.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from adaclip import adaptive as A
from adaclip import reference as R
from adaclip import strategies as S
from adaclip.errors import InvalidHyperparameterError

#: a matrix, a vector, a 3-d tensor and a scalar
SHAPES = [(3, 4), (5,), (2, 3, 2), ()]
D = sum(math.prod(s) for s in SHAPES)
SIGMA, BBAR = 1.3, 5.0
RTOL, ATOL = 1e-9, 1e-11


def split(v, lead=()):
    """Flat ``(..., d)`` → one array per tensor, shaped ``(*lead, *shape)``."""
    out, i = [], 0
    for shape in SHAPES:
        k = math.prod(shape)
        out.append(np.ascontiguousarray(v[..., i : i + k]).reshape((*lead, *shape)))
        i += k
    return out


def cat(arrays):
    """Per-tensor arrays (``None`` entries skipped) → one flat float64 vector."""
    parts = [np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays if a is not None]
    return np.concatenate(parts) if parts else np.zeros(0)


def flat_state(state: S.ClipState) -> dict:
    """A core ClipState in the reference's flat form (see adaclip.reference's state keys)."""
    out = {"step": int(state.step)}
    if state.std is not None:
        out["std"] = cat(state.std)
    if state.mean is not None:
        out["mean"] = cat(state.mean)
    for key, value in (state.extra or {}).items():
        out[key] = cat(value) if isinstance(value, list) else float(value)
    return out


def assert_states_close(core: dict, ref: dict, rtol=RTOL, atol=ATOL):
    assert set(core) == set(ref), (sorted(core), sorted(ref))
    assert core["step"] == ref["step"]
    for key in ref:
        if key != "step":
            np.testing.assert_allclose(core[key], ref[key], rtol=rtol, atol=atol, err_msg=key)


def noise_for(strategy, z, count_z):
    return split(z) + [np.asarray(count_z)] * strategy.num_auxiliary


def options_of(strategy):
    """The strategy's options as the reference's keyword arguments."""
    return dataclasses.asdict(strategy)


RULE = S.QuantileRule(target_quantile=0.6, learning_rate=0.3, count_noise_multiplier=1.0)

#: one strategy per option, and some combinations (std range wide enough that the clamps both
#: bind and do not, B̄ = 5 so that the noise matters)
BASE = dict(std_min=0.01, std_max=3.0, beta_mean=0.8, beta_std=0.7)
SEP = dict(scale="separated", max_grad_norm=1.5)
OPTIONS = {
    "patent": {},
    "centre=none": dict(centre="none"),
    "centre=debiased": dict(centre="debiased"),
    "centre=kalman": dict(centre="kalman", process_noise=0.3),
    "statistic=second_moment": dict(statistic="second_moment"),
    "correction=unbiased": dict(correction="unbiased"),
    "correction=none": dict(correction="none"),
    "pooling=tensor": dict(pooling="tensor"),
    "pooling=factored": dict(pooling="factored"),
    "update_every=3": dict(update_every=3),
    "separated": SEP,
    "separated p=1": dict(**SEP, shape_power=1.0),
    "separated+quantile": dict(**SEP, quantile=RULE),
    "freeze_statistics": dict(freeze_statistics=True),
    # combinations
    "factored+unbiased+delayed": dict(pooling="factored", correction="unbiased", update_every=2),
    "kalman+separated+quantile+tensor+none": dict(
        **SEP, centre="kalman", quantile=RULE, pooling="tensor", correction="none"
    ),
    "debiased+second_moment+factored+separated p=0.7": dict(
        **SEP, shape_power=0.7, centre="debiased", statistic="second_moment", pooling="factored"
    ),
    "frozen+kalman+separated+quantile": dict(**SEP, freeze_statistics=True, centre="kalman", quantile=RULE),
    "delayed+clamp+tensor+debiased": dict(update_every=2, pooling="tensor", centre="debiased"),
    # AdaClip()'s default preset (one number per tensor, read and written as such by the core)
    "centred preset: separated+tensor+unbiased": dict(**SEP, pooling="tensor", correction="unbiased"),
    "separated+tensor+none+second_moment p=1": dict(
        **SEP, shape_power=1.0, pooling="tensor", correction="none", statistic="second_moment"
    ),
}


def make(name):
    return S.AdaptiveClipping(**BASE, **OPTIONS[name])


def scale_then_privatize():
    return S.AdaptiveClipping.scale_then_privatize(1.2, beta=0.8, spread=50.0, update_every=2)


def batch(rng, n):
    """Training-like per-unit gradients: a common mean, unequal spreads per coordinate."""
    return 0.4 + rng.normal(size=(n, D)) * rng.uniform(0.05, 1.5, size=D)


def run_both(strategy, steps, *, rng, n=6, sigma=SIGMA, bbar=BBAR, make_batch=None):
    """``steps`` steps of the core and of the reference from their own initial states, compared
    after every step (release and whole state)."""
    kw = options_of(strategy)
    core = strategy.init([np.zeros(s) for s in SHAPES])
    ref = R.adaptive_init(SHAPES, **kw)
    assert_states_close(flat_state(core), ref, rtol=0, atol=0)
    for _ in range(steps):
        G = batch(rng, n) if make_batch is None else make_batch(rng)
        z, zc = rng.normal(size=D), rng.normal()
        out, core = S.private_step(strategy, core, split(G, (G.shape[0],)), noise_for(strategy, z, zc),
                                   noise_multiplier=sigma, expected_batch_size=bbar)  # fmt: skip
        want, ref = R.adaptive_clip_step(G, ref, z, zc, shapes=SHAPES, noise_multiplier=sigma,
                                         expected_batch_size=bbar, allow_empty=True, **kw)  # fmt: skip
        np.testing.assert_allclose(cat(out), want, rtol=RTOL, atol=ATOL)
        assert_states_close(flat_state(core), ref)
    return core, ref


# --------------------------------------------------------------------------- core = reference


@pytest.mark.parametrize("name", list(OPTIONS))
def test_core_equals_reference_over_steps(name):
    run_both(make(name), 5, rng=np.random.default_rng(sum(map(ord, name))))


def test_scale_then_privatize_equals_reference():
    run_both(scale_then_privatize(), 5, rng=np.random.default_rng(1))


def test_from_initial_clip_with_options_equals_reference():
    strategy = S.AdaptiveClipping.from_initial_clip(
        2.0, D, spread=10.0, centre="kalman", correction="unbiased", pooling="tensor"
    )
    run_both(strategy, 5, rng=np.random.default_rng(2))


@pytest.mark.parametrize("name", ["patent", "separated+quantile", "kalman+separated+quantile+tensor+none"])
def test_core_equals_reference_without_noise(name):
    run_both(make(name), 4, rng=np.random.default_rng(3), sigma=0.0)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_empty_batches_and_a_nan_unit(name):
    """Steps with no unit (noise only) and with a unit holding a NaN (dropped: it contributes
    nothing, to the count neither) agree with the reference, and the NaN unit's step equals the
    step without it."""
    strategy = make(name)
    rng = np.random.default_rng(4)

    def empty_or_nan(rng):
        if rng.random() < 0.5:
            return np.zeros((0, D))
        G = batch(rng, 3)
        G[1, rng.integers(D)] = np.nan
        return G

    core, _ = run_both(strategy, 5, rng=rng, make_batch=empty_or_nan)
    G = batch(rng, 3)
    bad = np.concatenate([G, G[:1]])
    bad[-1, 7] = np.inf
    z, zc = rng.normal(size=D), rng.normal()
    kw = dict(noise_multiplier=SIGMA, expected_batch_size=BBAR)
    out_bad, st_bad = S.private_step(strategy, core, split(bad, (4,)), noise_for(strategy, z, zc), **kw)
    out, st = S.private_step(strategy, core, split(G, (3,)), noise_for(strategy, z, zc), **kw)
    np.testing.assert_allclose(cat(out_bad), cat(out), rtol=1e-13, atol=1e-15)
    assert_states_close(flat_state(st_bad), flat_state(st), rtol=1e-13, atol=1e-15)


def test_quantile_clipping_equals_reference():
    rule = S.QuantileRule(target_quantile=0.7, learning_rate=0.4, count_noise_multiplier=2.0)
    strategy = S.QuantileClipping(max_grad_norm=0.8, quantile=rule)
    rng = np.random.default_rng(5)
    state = strategy.init([np.zeros(s) for s in SHAPES])
    clip_norm = 0.8
    for step in range(6):
        G = batch(rng, 6) * rng.uniform(0.2, 3.0)
        if step == 2:
            G[0, 3] = np.nan
        if step == 4:
            G = G[:0]
        z, zc = rng.normal(size=D), rng.normal()
        out, state = S.private_step(strategy, state, split(G, (G.shape[0],)), noise_for(strategy, z, zc),
                                    noise_multiplier=SIGMA, expected_batch_size=BBAR)  # fmt: skip
        want, clip_norm = R.quantile_clip_step(
            G, clip_norm, z, zc, noise_multiplier=SIGMA, expected_batch_size=BBAR, target_quantile=0.7,
            learning_rate=0.4, count_noise_multiplier=2.0, allow_empty=True,
        )  # fmt: skip
        np.testing.assert_allclose(cat(out), want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(float(strategy.transform(state, 4)[1][0]), clip_norm, rtol=RTOL)
        assert int(state.step) == step + 1


def test_quantile_clipping_default_count_noise_is_a_twentieth_of_the_batch():
    strategy = S.QuantileClipping()
    rng = np.random.default_rng(6)
    G, z, zc = batch(rng, 40), rng.normal(size=D), rng.normal()
    state = strategy.init([np.zeros(s) for s in SHAPES])
    out, state = S.private_step(strategy, state, split(G, (40,)), noise_for(strategy, z, zc),
                                noise_multiplier=3.0, expected_batch_size=40.0)  # fmt: skip
    want, clip_norm = R.quantile_clip_step(G, 1.0, z, zc, noise_multiplier=3.0, expected_batch_size=40.0)
    np.testing.assert_allclose(cat(out), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(float(state.extra["clip_norm"]), clip_norm, rtol=RTOL)


@pytest.mark.parametrize("max_grad_norm, stability", [(1.0, 0.01), (0.3, 0.5)])
def test_automatic_clipping_equals_reference(max_grad_norm, stability):
    strategy = S.AutomaticClipping(max_grad_norm=max_grad_norm, stability=stability)
    rng = np.random.default_rng(7)
    for n in (6, 0, 3):
        G = batch(rng, n) * 3.0
        if n == 3:
            G[2, 0] = np.nan
        z = rng.normal(size=D)
        out, state = S.private_step(strategy, strategy.init([np.zeros(s) for s in SHAPES]), split(G, (n,)),
                                    split(z), noise_multiplier=SIGMA, expected_batch_size=BBAR)  # fmt: skip
        want = R.automatic_clip_step(G, z, max_grad_norm=max_grad_norm, stability=stability,
                                     noise_multiplier=SIGMA, expected_batch_size=BBAR, allow_empty=True)  # fmt: skip
        np.testing.assert_allclose(cat(out), want, rtol=RTOL, atol=ATOL)
        assert state.step == 1 and state.mean is None and state.extra is None


def test_automatic_clipping_contributions_are_below_the_sensitivity():
    """One unit, no noise, B̄ = 1: the release is that unit's ``C·w/(‖w‖ + γ)``, norm < C."""
    strategy = S.AutomaticClipping(max_grad_norm=2.0, stability=0.05)
    for scale in (1e-3, 1.0, 1e6):
        g = np.random.default_rng(8).normal(size=(1, D)) * scale
        out, _ = S.private_step(strategy, S.ClipState(0), split(g, (1,)), None, noise_multiplier=0.0,
                                expected_batch_size=1.0)  # fmt: skip
        w = g[0] / 2.0
        np.testing.assert_allclose(cat(out), 2.0 * w / (np.linalg.norm(w) + 0.05), rtol=1e-12)
        assert np.linalg.norm(cat(out)) < 2.0


# --------------------------------------------------------------------------- the patent, bit for bit


def test_patent_defaults_are_the_patent_bit_for_bit():
    """The general reference with every option at its default is ``reference.adaclip_step``,
    bit for bit (np.array_equal), over several steps; and only the defaults are ``is_patent``."""
    rng = np.random.default_rng(9)
    kw = dict(std_min=0.01, std_max=3.0, beta_mean=0.8, beta_std=0.7)
    state = R.adaptive_init(SHAPES, **kw)
    m, s = state["mean"].copy(), state["std"].copy()
    for n in (6, 0, 4, 6, 2):
        G, z = batch(rng, n), rng.normal(size=D)
        got, state = R.adaptive_clip_step(G, state, z, shapes=SHAPES, noise_multiplier=SIGMA,
                                          expected_batch_size=BBAR, allow_empty=True, **kw)  # fmt: skip
        want, m, s = R.adaclip_step(G, m, s, z, noise_multiplier=SIGMA, expected_batch_size=BBAR,
                                    allow_empty=True, **kw)  # fmt: skip
        assert np.array_equal(got, want) and np.array_equal(state["mean"], m) and np.array_equal(state["std"], s)
        assert set(state) == {"step", "mean", "std"}
    assert S.AdaptiveClipping(**kw).is_patent
    assert S.AdaptiveClipping.from_initial_clip(1.0, D).is_patent
    for name in OPTIONS:
        assert make(name).is_patent == (name == "patent"), name
    assert not scale_then_privatize().is_patent


def test_patent_state_has_no_extra():
    state = make("patent").init([np.zeros(s) for s in SHAPES])
    assert state.extra is None and state.step == 0


# --------------------------------------------------------------------------- state from releases only


def released_twins(strategy, state, rng, *, sigma=SIGMA, bbar=BBAR):
    """Two different batches (sizes, scales, a NaN unit in one) and noise for each chosen so
    that the releases coincide: the gradient's noise absorbs the difference of the clipped
    sums, the count's noise the difference of the counts."""
    G1 = batch(rng, 5)
    G2 = batch(rng, 3) * 7.0
    G2[1, 2] = np.nan
    transformed = strategy.transform(state, len(SHAPES))
    sum1 = S.clip_and_sum(strategy, state, split(G1, (5,)), transformed=transformed)
    sum2 = S.clip_and_sum(strategy, state, split(G2, (3,)), transformed=transformed)
    sigma_g, sigma_b = strategy.noise_multipliers(sigma, bbar)
    z1, zc1 = rng.normal(size=D), rng.normal()
    z2 = z1 + (cat(sum1[:4]) - cat(sum2[:4])) / sigma_g
    zc2 = zc1 + (float(sum1[4]) - float(sum2[4])) / sigma_b if strategy.num_auxiliary else zc1
    if strategy.num_auxiliary:
        assert float(sum1[4]) != float(sum2[4])  # the counts differ: the count's noise matters
    return (G1, z1, zc1), (G2, z2, zc2)


STATEFUL = list(OPTIONS) + ["scale_then_privatize", "quantile_clipping"]


def stateful(name):
    if name == "scale_then_privatize":
        return scale_then_privatize()
    if name == "quantile_clipping":
        return S.QuantileClipping(max_grad_norm=0.7, quantile=RULE)
    return make(name)


@pytest.mark.parametrize("name", STATEFUL)
def test_state_is_a_function_of_the_releases_only(name):
    """Post-processing: batches that differ but give the same release (gradient and count) lead
    to the same state, step after step, on the core and on the reference; and the reference's
    update from the release alone gives that state."""
    strategy = stateful(name)
    rng = np.random.default_rng(10 + sum(map(ord, name)))
    kw = dict(noise_multiplier=SIGMA, expected_batch_size=BBAR)
    state = strategy.init([np.zeros(s) for s in SHAPES])
    adaptive = isinstance(strategy, S.AdaptiveClipping)
    ref = R.adaptive_init(SHAPES, **options_of(strategy)) if adaptive else None
    for _ in range(4):
        (G1, z1, zc1), (G2, z2, zc2) = released_twins(strategy, state, rng)
        out1, st1 = S.private_step(strategy, state, split(G1, (5,)), noise_for(strategy, z1, zc1), **kw)
        out2, st2 = S.private_step(strategy, state, split(G2, (3,)), noise_for(strategy, z2, zc2), **kw)
        np.testing.assert_allclose(cat(out1), cat(out2), rtol=1e-12, atol=1e-13)
        assert_states_close(flat_state(st1), flat_state(st2), rtol=1e-11, atol=1e-12)
        if adaptive:
            r1 = R.adaptive_clip_step(G1, ref, z1, zc1, shapes=SHAPES, **kw, **options_of(strategy))[1]
            r2 = R.adaptive_clip_step(G2, ref, z2, zc2, shapes=SHAPES, **kw, **options_of(strategy))[1]
            assert_states_close(r1, r2, rtol=1e-11, atol=1e-12)
            # the update takes the release and nothing else
            count = None
            if strategy.quantile is not None:
                sigma_b = R.count_noise_multiplier(strategy.quantile, BBAR)
                c1 = S.clip_and_sum(strategy, state, split(G1, (5,)))[4]
                count = float(c1) + sigma_b * zc1
            alone = R.adaptive_update(ref, cat(out1), count, shapes=SHAPES, **kw, **options_of(strategy))
            assert_states_close(alone, r1, rtol=1e-11, atol=1e-12)
            ref = r1
        state = st1


def test_release_with_equal_noisy_values_gives_equal_states():
    """The same through ``release`` (the framework paths' entry): clipped sums that differ,
    noise chosen to make the releases equal."""
    rng = np.random.default_rng(11)
    for name in ("separated+quantile", "factored+unbiased+delayed", "centre=kalman"):
        strategy = make(name)
        state = strategy.init([np.zeros(s) for s in SHAPES])
        sum1 = split(rng.normal(size=D)) + [np.asarray(1.5)] * strategy.num_auxiliary
        sum2 = split(rng.normal(size=D) * 3) + [np.asarray(-2.5)] * strategy.num_auxiliary
        sigma_g, sigma_b = strategy.noise_multipliers(1.5, 4.0)
        z1 = split(rng.normal(size=D)) + [np.asarray(0.3)] * strategy.num_auxiliary
        z2 = [a + (b - c) / (sigma_g if k < 4 else sigma_b) for k, (a, b, c) in enumerate(zip(z1, sum1, sum2))]
        out1, st1 = S.release(strategy, state, sum1, z1, noise_multiplier=1.5, expected_batch_size=4.0)
        out2, st2 = S.release(strategy, state, sum2, z2, noise_multiplier=1.5, expected_batch_size=4.0)
        np.testing.assert_allclose(cat(out1), cat(out2), rtol=1e-12)
        assert_states_close(flat_state(st1), flat_state(st2), rtol=1e-11, atol=1e-13)


# --------------------------------------------------------------------------- validation


QR = S.QuantileRule


@pytest.mark.parametrize(
    "make_bad, words",
    [
        (lambda: S.AdaptiveClipping(scale="split"), "scale must be one of"),
        (lambda: S.AdaptiveClipping(statistic="variance"), "statistic must be one of"),
        (lambda: S.AdaptiveClipping(correction="debias"), "correction must be one of"),
        (lambda: S.AdaptiveClipping(pooling="layer"), "pooling must be one of"),
        (lambda: S.AdaptiveClipping(centre="median"), "centre must be one of"),
        (lambda: S.AdaptiveClipping(scale="separated"), "needs max_grad_norm"),
        (lambda: S.AdaptiveClipping(scale="separated", max_grad_norm=0.0), "max_grad_norm"),
        (lambda: S.AdaptiveClipping(scale="separated", max_grad_norm=float("nan")), "max_grad_norm"),
        (lambda: S.AdaptiveClipping(max_grad_norm=1.0), "max_grad_norm applies to scale='separated'"),
        (lambda: S.AdaptiveClipping(quantile=QR()), "quantile adapts the clip norm of scale='separated'"),
        (lambda: S.AdaptiveClipping(shape_power=1.0), "shape_power applies to scale='separated'"),
        (lambda: S.AdaptiveClipping(scale="separated", max_grad_norm=1.0, shape_power=0.0), "shape_power"),
        (lambda: S.AdaptiveClipping(scale="separated", max_grad_norm=1.0, quantile=0.5), "QuantileRule"),
        (lambda: S.AdaptiveClipping(update_every=0), "update_every"),
        (lambda: S.AdaptiveClipping(update_every=1.5), "update_every"),
        (lambda: S.AdaptiveClipping(update_every=True), "update_every"),
        (lambda: S.AdaptiveClipping(process_noise=0.0), "process_noise"),
        (lambda: S.AdaptiveClipping(process_noise=-1.0), "process_noise"),
        (lambda: S.AdaptiveClipping(freeze_statistics="yes"), "freeze_statistics"),
        (lambda: S.AdaptiveClipping.from_initial_clip(1.0, 10, max_grad_norm=1.0), "max_grad_norm"),
        (lambda: QR(target_quantile=0.0), "target_quantile"),
        (lambda: QR(target_quantile=1.0), "target_quantile"),
        (lambda: QR(target_quantile=1.5), "target_quantile"),
        (lambda: QR(learning_rate=0.0), "learning_rate"),
        (lambda: QR(count_noise_multiplier=-1.0), "count_noise_multiplier"),
        (lambda: QR(count_noise_multiplier=float("inf")), "count_noise_multiplier"),
        (lambda: S.QuantileClipping(max_grad_norm=0.0), "max_grad_norm"),
        (lambda: S.QuantileClipping(quantile=0.5), "QuantileRule"),
        (lambda: S.AutomaticClipping(max_grad_norm=-1.0), "max_grad_norm"),
        (lambda: S.AutomaticClipping(stability=0.0), "stability"),
        (lambda: QR(count_noise_multiplier=1.0).noise_multipliers(2.0, 10.0), r"noise_multiplier < 2·count_noise"),
        (lambda: QR().noise_multipliers(0.6, 4.0), "count_noise_multiplier"),  # B̄/20 = 0.2: 0.6 ≥ 0.4
        (lambda: S.QuantileClipping().noise_multipliers(5.0, 40.0), "count_noise_multiplier"),
        (lambda: make("separated+quantile").noise_multipliers(2.0, 5.0), "count_noise_multiplier"),
    ],
)
def test_invalid_hyperparameters_raise(make_bad, words):
    with pytest.raises(InvalidHyperparameterError, match=words):
        make_bad()


def test_invalid_public_statistics_raise():
    strategy = make("patent")
    state = strategy.init([np.zeros(s) for s in SHAPES])
    good = split(np.zeros((3, D)), (3,))
    for bad, words in [
        (dict(weight=0.0), "weight"), (dict(weight=1.5), "weight"), (dict(weight=float("nan")), "weight"),
    ]:  # fmt: skip
        with pytest.raises(InvalidHyperparameterError, match=words):
            strategy.with_public_statistics(state, good, **bad)
    with pytest.raises(InvalidHyperparameterError, match="at least 2 examples"):
        strategy.with_public_statistics(state, split(np.zeros((1, D)), (1,)))
    with pytest.raises(InvalidHyperparameterError, match="public gradient arrays"):
        strategy.with_public_statistics(state, good[:2])
    with pytest.raises(InvalidHyperparameterError, match="expected"):
        strategy.with_public_statistics(state, [good[1], good[0], good[2], good[3]])


def test_a_sigma_beyond_the_count_noise_changes_nothing():
    """σ ≥ 2σ_b is refused before anything is computed (the state is left as it was)."""
    strategy = make("separated+quantile")
    state = strategy.init([np.zeros(s) for s in SHAPES])
    rng = np.random.default_rng(12)
    before = flat_state(state)
    with pytest.raises(InvalidHyperparameterError):
        S.private_step(strategy, state, split(batch(rng, 3), (3,)), noise_for(strategy, rng.normal(size=D), 0.1),
                       noise_multiplier=2.5, expected_batch_size=BBAR)  # fmt: skip
    assert_states_close(flat_state(state), before, rtol=0, atol=0)


def test_reference_validates_the_same_options():
    for bad in [dict(scale="x"), dict(pooling="x"), dict(scale="separated"), dict(update_every=0),
                dict(max_grad_norm=1.0), dict(quantile=dict(target_quantile=0.5)), dict(centre="x"),
                dict(scale="separated", max_grad_norm=1.0, quantile=dict(target_quantile=1.0)), dict(colour=1)]:  # fmt: skip
        with pytest.raises(InvalidHyperparameterError):
            R.adaptive_init(SHAPES, **bad)
    with pytest.raises(InvalidHyperparameterError, match="noise_multiplier must be < 2"):
        R.split_noise_multiplier(1.0, 0.5)


# --------------------------------------------------------------------------- public statistics


@pytest.mark.parametrize("pooling", ["coordinate", "tensor", "factored"])
@pytest.mark.parametrize("correction", ["clamp", "unbiased"])
def test_public_statistics_by_hand(pooling, correction):
    """Two public examples: ``var_j = (g_1j − g_2j)²/2``, pooled, clamped, mixed with weight ½
    into the variance EMAs; the centre, window and step are untouched."""
    shapes = [(2, 3), (4,)]
    lo, hi = 0.1, 2.0
    strategy = S.AdaptiveClipping(std_min=lo, std_max=hi, pooling=pooling, correction=correction, update_every=2)
    state = strategy.init([np.zeros(s) for s in shapes])
    state = state._replace(mean=[np.full((2, 3), 0.25), np.full(4, -0.5)])
    g1 = np.array([0.0, 1.0, 2.0, 3.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0])
    g2 = np.array([1.0, 1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 0.0, 4.0, 1.0])
    var = (g1 - g2) ** 2 / 2  # [.5, 0, 2, 4.5, .5, 0 | .5, .5, 4.5, 0]
    public = [np.stack([g1[:6].reshape(2, 3), g2[:6].reshape(2, 3)]), np.stack([g1[6:], g2[6:]])]
    new = strategy.with_public_statistics(state, public, weight=0.5)
    s0sq = lo * hi  # s_0² = std_min·std_max = 0.2
    clamp = lambda x: np.clip(x, lo**2, hi**2)  # noqa: E731
    mix = lambda x: 0.5 * s0sq + 0.5 * clamp(x)  # noqa: E731
    if pooling == "coordinate":
        want = mix(var)
    elif pooling == "tensor":
        want = np.concatenate([np.full(6, mix(var[:6].mean())), np.full(4, mix(var[6:].mean()))])
    else:  # the matrix: rows [.5, 0, 2 | 4.5, .5, 0] → means [2.5/3, 5/3]; columns [2.5, .25, 1]
        rows = mix(np.array([2.5 / 3, 5.0 / 3]))
        cols = mix(np.array([2.5, 0.25, 1.0]))
        matrix = np.clip(np.outer(rows, cols) / rows.mean(), lo**2, hi**2).reshape(-1)
        want = np.concatenate([matrix, np.full(4, mix(var[6:].mean()))])
        np.testing.assert_allclose(cat(new.extra["rows"]), rows, rtol=1e-14)
        np.testing.assert_allclose(cat(new.extra["cols"]), cols, rtol=1e-14)
    np.testing.assert_allclose(cat(new.std), np.sqrt(clamp(want)), rtol=1e-14)
    np.testing.assert_array_equal(cat(new.mean), cat(state.mean))
    assert new.step == 0 and float(new.extra["window_count"]) == 0.0
    # and the reference agrees
    ref = R.adaptive_init(shapes, **options_of(strategy))
    ref["mean"] = cat(state.mean)
    got = R.public_statistics(ref, np.stack([g1, g2]), shapes=shapes, weight=0.5, **options_of(strategy))
    np.testing.assert_allclose(got["std"], cat(new.std), rtol=1e-14)


def test_frozen_public_statistics_stay_and_shape_the_separated_scale():
    """Frozen statistics from public data: ``s`` stays, the centre moves, and ``b`` is
    ``C·√s/mean(√s)``."""
    strategy = S.AdaptiveClipping(std_min=1e-3, std_max=10.0, scale="separated", max_grad_norm=2.0,
                                  freeze_statistics=True)  # fmt: skip
    rng = np.random.default_rng(13)
    public = split(rng.normal(size=(8, D)) * rng.uniform(0.1, 3.0, size=D), (8,))
    state = strategy.with_public_statistics(strategy.init([np.zeros(s) for s in SHAPES]), public)
    std = cat(state.std)
    np.testing.assert_allclose(std, np.clip(np.std(cat_rows(public), axis=0, ddof=1), 1e-3, 10.0), rtol=1e-12)
    for _ in range(3):
        G, z = batch(rng, 4), rng.normal(size=D)
        _, state = S.private_step(strategy, state, split(G, (4,)), split(z), noise_multiplier=SIGMA,
                                  expected_batch_size=BBAR)  # fmt: skip
        np.testing.assert_array_equal(cat(state.std), std)
        assert np.any(cat(state.mean) != 0)
    b = cat(strategy.transform(state, 4)[1])
    np.testing.assert_allclose(b, 2.0 * np.sqrt(std) / np.mean(np.sqrt(std)), rtol=1e-12)


def cat_rows(per_tensor):
    """Per-tensor ``(n, *shape)`` arrays → ``(n, d)``."""
    return np.concatenate([np.asarray(a).reshape(a.shape[0], -1) for a in per_tensor], axis=1)


# --------------------------------------------------------------------------- parts


@pytest.mark.parametrize("rho", [0.01, 0.3, 4.0])
def test_kalman_gain_settles_at_its_fixed_point(rho):
    """With a constant noise level the gain tends to ``K* = (√(ρ² + 4ρ) − ρ)/2``; the first
    release is taken whole (K = 1), and every step is ``m' = m + K(g̃ − m)``, ``P' = K·R``."""
    C, sigma = 1.5, 0.8
    strategy = S.AdaptiveClipping(centre="kalman", process_noise=rho, scale="separated", max_grad_norm=C,
                                  freeze_statistics=True)  # fmt: skip
    R_noise = C**2 * sigma**2 / BBAR**2  # b = C everywhere: R = b²σ²/B̄²
    state = strategy.init([np.zeros(s) for s in SHAPES])
    rng = np.random.default_rng(14)
    gains = []
    for t in range(400):
        g = split(rng.normal(size=D))
        _, scale = strategy.transform(state, 4)
        new = strategy.update(state, g, scale, noise_multiplier=sigma, expected_batch_size=BBAR)
        gain = cat(new.extra["centre_var"]) / R_noise
        np.testing.assert_allclose(cat(new.mean), cat(state.mean) + gain * (cat(g) - cat(state.mean)), rtol=1e-12,
                                   atol=1e-14)  # fmt: skip
        if t == 0:
            np.testing.assert_allclose(cat(new.mean), cat(g), rtol=0, atol=0)
        gains.append(gain)
        state = new
    k_star = (math.sqrt(rho * rho + 4 * rho) - rho) / 2
    np.testing.assert_allclose(gains[0], 1.0, rtol=1e-12)
    np.testing.assert_allclose(gains[-1], k_star, rtol=1e-9)
    # the same fixed point from the part itself, and from the reference's update
    m, p = A.kalman_update([np.zeros(3)], [np.full(3, -1.0)], [np.ones(3)], [R_noise], process_noise=rho)
    ref = {"step": 0, "std": np.ones(3), "mean": np.zeros(3), "centre_var": np.full(3, -1.0)}
    kw = dict(scale="separated", max_grad_norm=C, centre="kalman", process_noise=rho, freeze_statistics=True)
    for _ in range(400):
        m, p = A.kalman_update(m, p, [np.ones(3)], [R_noise], process_noise=rho)
        ref = R.adaptive_update(ref, np.ones(3), shapes=[(3,)], noise_multiplier=sigma, expected_batch_size=BBAR, **kw)
    np.testing.assert_allclose(p[0] / R_noise, k_star, rtol=1e-9)
    np.testing.assert_allclose(ref["centre_var"] / R_noise, k_star, rtol=1e-9)


def test_kalman_without_noise_takes_every_release_whole():
    strategy = S.AdaptiveClipping(centre="kalman")
    state = strategy.init([np.zeros(s) for s in SHAPES])
    rng = np.random.default_rng(15)
    for _ in range(3):
        g = split(rng.normal(size=D))
        state = strategy.update(state, g, strategy.transform(state, 4)[1], noise_multiplier=0.0,
                                expected_batch_size=BBAR)  # fmt: skip
        np.testing.assert_allclose(cat(state.mean), cat(g), rtol=1e-15, atol=1e-16)  # m + 1·(g̃ − m)


@pytest.mark.parametrize("beta_mean", [0.5, 0.9, 0.999])
def test_debiased_centre_of_a_constant_release_is_that_release(beta_mean):
    """After t ≥ 1 steps of the same release c, ``m/(1 − β₁ᵗ) = c`` (the EMA's zero start
    corrected); at t = 0 the centre is 0."""
    strategy = S.AdaptiveClipping(centre="debiased", beta_mean=beta_mean)
    state = strategy.init([np.zeros(s) for s in SHAPES])
    np.testing.assert_array_equal(cat(strategy.centre_of(state)), np.zeros(D))
    c = split(np.random.default_rng(16).normal(size=D))
    for _ in range(12):
        state = strategy.update(state, c, strategy.transform(state, 4)[1], noise_multiplier=SIGMA,
                                expected_batch_size=BBAR)  # fmt: skip
        np.testing.assert_allclose(cat(strategy.centre_of(state)), cat(c), rtol=1e-11, atol=1e-14)
        a, _ = R.adaptive_transform(flat_state(state), **options_of(strategy))
        np.testing.assert_allclose(a, cat(c), rtol=1e-11, atol=1e-14)
    # the part under jax-like array steps too
    got = A.debiased_centre([np.ones(3)], np.asarray(3), 0.5)
    np.testing.assert_allclose(got[0], 1.0 / (1 - 0.125))
    np.testing.assert_array_equal(A.debiased_centre([np.ones(3)], np.asarray(0), 0.5)[0], np.zeros(3))


def _variance_after(strategy, releases, state=None):
    """The (unclamped) variance EMA after ``update`` with each release in turn."""
    state = strategy.init([np.zeros(s) for s in SHAPES]) if state is None else state
    for g in releases:
        state = strategy.update(state, split(g), strategy.transform(state, 4)[1], noise_multiplier=SIGMA,
                                expected_batch_size=BBAR)  # fmt: skip
    return cat(state.extra["variance"])


@pytest.mark.parametrize("k", [2, 3, 4])
def test_delayed_statistics_target_the_undelayed_quantity(k):
    """``v = D²/k − N/k`` targets what ``v = x² − n`` targets when the signal's parts are
    zero-mean fluctuations (the centre tracks the mean): averaged over the 2ᵏ sign patterns of
    the k signals (cross terms cancel), the delayed estimate is exactly the average of the k
    undelayed ones. β₂ = 0 so the EMA holds the last ``v``; centre "none" so ``x = g̃``."""
    opts = dict(std_min=1e-3, std_max=10.0, beta_std=0.0, centre="none", correction="unbiased")
    delayed = S.AdaptiveClipping(update_every=k, **opts)
    undelayed = S.AdaptiveClipping(**opts)
    xs = np.random.default_rng(17).normal(size=(k, D))
    patterns = [
        _variance_after(delayed, [sign * x for sign, x in zip(signs, xs)])
        for signs in itertools.product([1.0, -1.0], repeat=k)
    ]
    each = [_variance_after(undelayed, [x]) for x in xs]  # same initial state, hence the same n
    np.testing.assert_allclose(np.mean(patterns, axis=0), np.mean(each, axis=0), rtol=1e-10, atol=1e-12)
    # the statistics move only at the window's end
    state = delayed.init([np.zeros(s) for s in SHAPES])
    for j, x in enumerate(xs):
        before = cat(state.std)
        state = delayed.update(state, split(x), delayed.transform(state, 4)[1], noise_multiplier=SIGMA,
                               expected_batch_size=BBAR)  # fmt: skip
        assert float(state.extra["window_count"]) == (j + 1) % k
        assert np.array_equal(cat(state.std), before) == (j < k - 1)


@pytest.mark.parametrize("k", [2, 5])
def test_delayed_statistics_of_constant_releases(k):
    """Constant releases with no noise: the undelayed ``v = x²``, the delayed ``v = D²/k = k·x²``
    (as documented in adaclip.adaptive: the window's sum is scaled for zero-mean fluctuations,
    so a persistent signal counts k times); with noise ``n`` subtracted once per window's
    average either way. Equal for k = 1 only; the delayed with the *average* ``D/k`` replayed k
    times, i.e. ``v·k``, hold the same quantity."""
    opts = dict(std_min=1e-3, std_max=10.0, beta_std=0.0, centre="none", correction="unbiased")
    x = np.random.default_rng(18).normal(size=D)
    undelayed = S.AdaptiveClipping(**opts)
    delayed = S.AdaptiveClipping(update_every=k, **opts)

    def variance(strategy, steps, sigma):
        state = strategy.init([np.zeros(s) for s in SHAPES])
        for _ in range(steps):
            state = strategy.update(state, split(x), strategy.transform(state, 4)[1], noise_multiplier=sigma,
                                    expected_batch_size=BBAR)  # fmt: skip
        return cat(state.extra["variance"]), cat(strategy.transform(state, 4)[1])

    v1, _ = variance(undelayed, 1, 0.0)
    vk, _ = variance(delayed, k, 0.0)
    np.testing.assert_allclose(v1, x**2, rtol=1e-14)
    np.testing.assert_allclose(vk, k * x**2, rtol=1e-13)
    # with noise: every release of the window had the same b (the statistics did not move), so
    # N/k = n and v = k·x² − n, against x² − n undelayed
    b0 = cat(delayed.transform(delayed.init([np.zeros(s) for s in SHAPES]), 4)[1])
    n = b0**2 * SIGMA**2 / BBAR**2
    v1, _ = variance(undelayed, 1, SIGMA)
    vk, _ = variance(delayed, k, SIGMA)
    np.testing.assert_allclose(v1, x**2 - n, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(vk, k * x**2 - n, rtol=1e-12, atol=1e-14)


def test_factored_estimate_is_rank_one_and_ignores_negative_factors():
    """``R⁺_i K⁺_j/mean(R⁺)`` reproduces a rank-one ``v = r cᵀ`` exactly; a factor below 0 (the
    unbiased correction allows it) counts as 0, never making two negatives a positive variance;
    all rows ≤ 0 give the floor."""
    r, c = np.array([0.5, 2.0, 1.0]), np.array([0.2, 1.0, 3.0, 0.4])
    v = np.outer(r, c)
    rows, cols = v.mean(axis=1), v.mean(axis=0)
    np.testing.assert_allclose(A.estimate((rows, cols), (3, 4), (1e-6, 1e6)), v, rtol=1e-14)
    neg = A.estimate((np.array([-1.0, 2.0, 3.0]), np.array([-2.0, 1.0])), (3, 2), (0.01, 10.0))
    np.testing.assert_allclose(neg, [[0.01, 0.01], [0.01, 1.2], [0.01, 1.8]], rtol=1e-14)
    floor = A.estimate((np.array([-1.0, -2.0]), np.array([-2.0, 1.0])), (2, 2), (0.01, 10.0))
    np.testing.assert_array_equal(floor, np.full((2, 2), 0.01))


def test_unbiased_factored_statistics_in_pure_noise_stay_at_the_floor():
    """Pure noise (no units) drives the unbiased EMAs below 0: the estimate goes to std_min,
    not to std_max (it did before: two negative factors made a large positive estimate, and
    ``mean(R) ≤ 0`` fell back to ``R_i K_j`` with a denominator of 1)."""
    strategy = S.AdaptiveClipping(std_min=1e-3, std_max=10.0, beta_std=0.5, pooling="factored",
                                  correction="unbiased")  # fmt: skip
    rng = np.random.default_rng(19)
    _, ref = run_both(strategy, 8, rng=rng, sigma=3.0, bbar=1.0, make_batch=lambda rng: np.zeros((0, D)))
    std = ref["std"]
    assert np.all(std[:12] == 1e-3) and np.all(std[17:29] == 1e-3), std  # the matrix and the 3-d tensor


def test_separated_scale_of_equal_statistics_is_flat_clipping():
    """Equal ``s`` everywhere: ``b = C`` on every coordinate, so the step is DP-SGD at C."""
    strategy = S.AdaptiveClipping(scale="separated", max_grad_norm=0.9, centre="none", shape_power=0.8)
    flat = S.FlatClipping(0.9)
    rng = np.random.default_rng(20)
    G, z = batch(rng, 6) * 2.0, rng.normal(size=D)
    params = [np.zeros(s) for s in SHAPES]
    out, _ = S.private_step(strategy, strategy.init(params), split(G, (6,)), split(z), noise_multiplier=SIGMA,
                            expected_batch_size=BBAR)  # fmt: skip
    want, _ = S.private_step(flat, flat.init(params), split(G, (6,)), split(z), noise_multiplier=SIGMA,
                             expected_batch_size=BBAR)  # fmt: skip
    np.testing.assert_allclose(cat(out), cat(want), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(cat(A.separated_scale(split(np.full(D, 0.37)), 0.9, 0.8)), np.full(D, 0.9), rtol=1e-14)


def test_quantile_clip_norm_moves_towards_the_target_quantile():
    """No noise: with every unit inside the ball (f = 1 > γ) C shrinks by exp(−η(1 − γ)); with
    every unit outside (f = 0) it grows by exp(ηγ)."""
    rule = S.QuantileRule(target_quantile=0.6, learning_rate=0.5, count_noise_multiplier=1.0)
    strategy = S.QuantileClipping(max_grad_norm=2.0, quantile=rule)
    state = strategy.init([np.zeros(s) for s in SHAPES])
    rng = np.random.default_rng(21)
    small = rng.normal(size=(4, D)) * 1e-3
    _, state = S.private_step(strategy, state, split(small, (4,)), None, noise_multiplier=0.0, expected_batch_size=4.0)
    np.testing.assert_allclose(float(state.extra["clip_norm"]), 2.0 * math.exp(-0.5 * 0.4), rtol=1e-14)
    big = rng.normal(size=(4, D)) * 1e3
    _, state = S.private_step(strategy, state, split(big, (4,)), None, noise_multiplier=0.0, expected_batch_size=4.0)
    np.testing.assert_allclose(float(state.extra["clip_norm"]), 2.0 * math.exp(-0.5 * 0.4 + 0.5 * 0.6), rtol=1e-14)
