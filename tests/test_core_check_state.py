"""``strategy.check_state``: a restored strategy state is checked against the strategy's own.

Every built-in strategy has the method (:func:`adaclip.mechanism.check_state`). A state the
strategy produced itself passes, copied and cast to the template's dtype (the negative
control: the checks refuse faults, not states); each documented fault is refused with
:class:`InvalidHyperparameterError` — shapes, dtypes, NaN/inf, entries present or missing,
AdaCliP's ``s`` outside ``[std_min, std_max]``, step counts, and the ranges of the option
state. The same faults put into a PyTorch checkpoint give the PyTorch loader's message, word
for word, so that the wrappers can call the core instead of their own checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from adaclip import strategies as S
from adaclip.errors import InvalidHyperparameterError

SHAPES = [(3, 4), (5,), (2, 3, 2)]
SIGMA, BBAR = 0.5, 8.0


def _params(dtype=np.float64):
    rng = np.random.default_rng(0)
    return [rng.normal(size=s).astype(dtype) for s in SHAPES]


def _options_strategy() -> S.AdaptiveClipping:
    """Every kind of option state: variance accumulators (factored rows/cols), a delay
    window, the Kalman variance and the quantile rule's C_t."""
    return S.AdaptiveClipping(
        std_min=1e-3, std_max=10.0, scale="separated", max_grad_norm=1.0, correction="unbiased",
        pooling="factored", update_every=3, centre="kalman", quantile=S.QuantileRule(),
    )  # fmt: skip


def _trained(strategy, steps=4, dtype=np.float64):
    params = _params(dtype)
    rng = np.random.default_rng(1)
    state = strategy.init(params)
    for _ in range(steps):
        grads = [rng.normal(size=(6, *s)).astype(dtype) for s in SHAPES]
        noise = [rng.normal(size=s).astype(dtype) for s in SHAPES] + [
            np.asarray(rng.normal(), dtype=dtype) for _ in range(strategy.num_auxiliary)
        ]
        _, state = S.private_step(strategy, state, grads, noise, noise_multiplier=SIGMA, expected_batch_size=BBAR)
    return strategy.init(params), state


def _equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------- acceptance


@pytest.mark.parametrize(
    "strategy",
    [
        S.AdaptiveClipping(),
        _options_strategy(),
        S.adaptive_clipping(sum(math.prod(s) for s in SHAPES)),
        S.QuantileClipping(max_grad_norm=0.5),
        S.FlatClipping(1.0),
        S.AutomaticClipping(),
    ],
    ids=["patent", "options", "centred", "quantile", "flat", "automatic"],
)
def test_a_state_the_strategy_made_passes_unchanged_and_copied(strategy):
    like, state = _trained(strategy)
    out = strategy.check_state(state, like)
    assert isinstance(out, S.ClipState) and out.step == 4 and type(out.step) is int
    for key in ("mean", "std"):
        assert _equal(getattr(out, key), getattr(state, key))
    assert (out.extra is None) == (state.extra is None)
    for key, value in (state.extra or {}).items():
        assert _equal(out.extra[key], value)
    if state.std is not None:  # copies, not the same arrays
        assert all(o is not s for o, s in zip(out.std, state.std))


def test_the_arrays_take_the_template_dtype_and_integer_arrays_count():
    strategy = _options_strategy()
    like32, _ = _trained(strategy, steps=0, dtype=np.float32)
    _, state64 = _trained(strategy)
    state = state64._replace(step=np.asarray(4, dtype=np.int64))
    out = strategy.check_state(state, like32)
    assert out.step == 4 and type(out.step) is int
    assert all(s.dtype == np.float32 for s in out.std)
    assert out.extra["clip_norm"].dtype == np.float32
    # a whole-number window count saved as int64 is a real dtype: accepted
    ints = state._replace(extra={**state.extra, "window_count": np.asarray(2, dtype=np.int64)})
    assert float(strategy.check_state(ints, like32).extra["window_count"]) == 2.0


def test_option_ranges_accept_their_edges():
    strategy = _options_strategy()
    like, state = _trained(strategy)
    extra = dict(state.extra)
    extra["centre_var"] = [np.full_like(v, -1.0) for v in extra["centre_var"]]  # no observation yet
    extra["variance"] = [None if v is None else -np.abs(v) for v in extra["variance"]]  # unbiased: may be < 0
    extra["window_count"] = np.asarray(2.0)  # update_every - 1
    extra["window_noise"] = [np.zeros_like(v) for v in extra["window_noise"]]
    strategy.check_state(state._replace(extra=extra), like)


def test_std_at_its_bounds_within_rounding_passes():
    strategy = S.AdaptiveClipping(std_min=1e-3, std_max=10.0)
    like, state = _trained(strategy)
    std = [np.full_like(s, 10.0 * (1 + 1e-15)) for s in state.std]
    strategy.check_state(state._replace(std=std), like)


# --------------------------------------------------------------------------- refusals


def _set(state, key, k, value):
    values = list(getattr(state, key))
    values[k] = value
    return state._replace(**{key: values})


def _set_extra(state, key, value, k=None):
    extra = dict(state.extra)
    if k is None:
        extra[key] = value
    else:
        extra[key] = list(extra[key])
        extra[key][k] = value
    return state._replace(extra=extra)


FAULTS = {
    "std shape": (lambda s: _set(s, "std", 0, np.ones((2, 2))), r"clip_state\['std'\] for tensor 0 has shape \(2, 2\), expected \(3, 4\)"),
    "std NaN": (lambda s: _set(s, "std", 1, np.full(5, np.nan)), r"clip_state\['std'\] for tensor 1 contains NaN or inf"),
    "std dtype": (lambda s: _set(s, "std", 1, np.ones(5, dtype=bool)), r"has dtype bool, expected a real dtype"),
    "std not an array": (lambda s: _set(s, "std", 1, [[1.0], [1.0, 2.0]]), r"clip_state\['std'\] for tensor 1 is not a tensor: list"),
    "std below std_min": (
        lambda s: _set(s, "std", 2, np.full((2, 3, 2), 1e-4)),
        r"clip_state\['std'\] for tensor 2 is outside \[std_min, std_max\] = \[0.001, 10.0\]",
    ),
    "std above std_max": (lambda s: _set(s, "std", 0, np.full((3, 4), 11.0)), r"is outside \[std_min, std_max\]"),
    "std missing": (lambda s: s._replace(std=None), r"clip_state\['std'\] does not match the strategy"),
    "mean missing": (lambda s: s._replace(mean=None), r"clip_state\['mean'\] does not match the strategy"),
    "mean too short": (lambda s: s._replace(mean=s.mean[:2]), r"clip_state\['mean'\] has 2 tensors, expected 3"),
    "mean inf": (lambda s: _set(s, "mean", 0, np.full((3, 4), np.inf)), r"clip_state\['mean'\] for tensor 0 contains NaN"),
    "step negative": (lambda s: s._replace(step=-1), r"clip_state\['step'\] must be an int >= 0, got -1"),
    "step float": (lambda s: s._replace(step=2.0), r"clip_state\['step'\] must be an int >= 0, got 2.0"),
    "step bool": (lambda s: s._replace(step=True), r"clip_state\['step'\] must be an int >= 0"),
    "extra missing key": (
        lambda s: s._replace(extra={k: v for k, v in s.extra.items() if k != "clip_norm"}),
        r"does not match the strategy's options: missing \['clip_norm'\], unexpected \[\]",
    ),
    "extra not a dict": (lambda s: s._replace(extra=None), r"clip_state\['extra'\] must be a dict with"),
    "extra list too short": (
        lambda s: _set_extra(s, "centre_var", s.extra["centre_var"][:1]),
        r"clip_state\['extra'\]\['centre_var'\] must be a list of 3 entries",
    ),
    "extra None for an array": (
        lambda s: _set_extra(s, "centre_var", None, k=0),
        r"\['centre_var'\] for tensor 0 is None, expected a tensor",
    ),
    "extra array for a None": (
        lambda s: _set_extra(s, "variance", np.ones((3, 4)), k=0),
        r"\['variance'\] for tensor 0 is a tensor, expected None",
    ),
    "clip_norm zero": (lambda s: _set_extra(s, "clip_norm", np.asarray(0.0)), r"\['clip_norm'\] must be > 0, got 0.0"),
    "window_count at k": (
        lambda s: _set_extra(s, "window_count", np.asarray(3.0)),
        r"\['window_count'\] must be a whole number in \[0, update_every=3\), got 3.0",
    ),
    "window_count fractional": (lambda s: _set_extra(s, "window_count", np.asarray(0.5)), r"must be a whole number"),
    "window_noise negative": (
        lambda s: _set_extra(s, "window_noise", -np.ones(5), k=1),
        r"\['window_noise'\] must be >= 0 \(a sum of noise variances\)",
    ),
    "centre_var below 0": (
        lambda s: _set_extra(s, "centre_var", np.full(5, -0.5), k=1),
        r"\['centre_var'\] must be >= 0, or -1 where no release",
    ),
    "rows NaN": (lambda s: _set_extra(s, "rows", np.full(3, np.nan), k=0), r"\['rows'\] for tensor 0 contains NaN or inf"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_is_refused(fault):
    strategy = _options_strategy()
    like, state = _trained(strategy)
    strategy.check_state(state, like)  # the control: unchanged, it passes
    corrupt, message = FAULTS[fault]
    with pytest.raises(InvalidHyperparameterError, match=r"^state_dict .*?" + message):
        strategy.check_state(corrupt(state), like)


def test_names_and_source_enter_the_messages():
    strategy = S.AdaptiveClipping()
    like, state = _trained(strategy)
    bad = _set(state, "std", 1, np.full(5, np.nan))
    with pytest.raises(InvalidHyperparameterError, match=r"^restored state clip_state\['std'\] for 'fc.bias' contains"):
        strategy.check_state(bad, like, names=["fc.weight", "fc.bias", "conv"], source="restored state")


def test_option_state_for_a_strategy_that_keeps_none_is_refused():
    strategy = S.FlatClipping(1.0)
    like = strategy.init(_params())
    assert strategy.check_state(S.ClipState(step=7), like).step == 7
    with pytest.raises(InvalidHyperparameterError, match=r"has option state \['clip_norm'\], but FlatClipping keeps none"):
        strategy.check_state(S.ClipState(step=7, extra={"clip_norm": np.asarray(1.0)}), like)
    with pytest.raises(InvalidHyperparameterError, match=r"clip_state\['std'\] does not match the strategy"):
        strategy.check_state(S.ClipState(step=7, std=[np.ones(s) for s in SHAPES]), like)


def test_the_checks_run_on_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    strategy = _options_strategy()
    like, state = _trained(strategy)
    to_jax = lambda s: S.ClipState(  # noqa: E731
        step=jnp.asarray(s.step),
        mean=[jnp.asarray(m) for m in s.mean],
        std=[jnp.asarray(v) for v in s.std],
        extra={k: [None if x is None else jnp.asarray(x) for x in v] if isinstance(v, list) else jnp.asarray(v)
               for k, v in s.extra.items()},
    )  # fmt: skip
    like_j = to_jax(like)
    out = strategy.check_state(to_jax(state), like_j)
    assert out.step == 4  # (float32 unless JAX runs with x64)
    assert all(np.allclose(np.asarray(o), s, rtol=1e-6) for o, s in zip(out.std, state.std))
    bad = _set_extra(state, "window_count", np.asarray(3.0))
    with pytest.raises(InvalidHyperparameterError, match=r"must be a whole number in \[0, update_every=3\)"):
        strategy.check_state(to_jax(bad), like_j)


# --------------------------------------------------------------------------- same as the PyTorch loader


TORCH_FAULTS = [
    ("std shape", lambda cs: cs["std"].__setitem__(0, _torch().ones(2, 2))),
    ("std NaN", lambda cs: cs["std"].__setitem__(1, _torch().full_like(cs["std"][1], float("nan")))),
    ("std out of range", lambda cs: cs["std"].__setitem__(2, _torch().full_like(cs["std"][2], 1e6))),
    ("mean short", lambda cs: cs.__setitem__("mean", cs["mean"][:1])),
    ("step negative", lambda cs: cs.__setitem__("step", -3)),
    ("clip_norm", lambda cs: cs["extra"].__setitem__("clip_norm", _torch().tensor(-1.0))),
    ("window_count", lambda cs: cs["extra"].__setitem__("window_count", _torch().tensor(5.0))),
    ("centre_var", lambda cs: cs["extra"]["centre_var"].__setitem__(0, _torch().full_like(cs["extra"]["centre_var"][0], -2.0))),
    ("extra keys", lambda cs: cs["extra"].pop("window_noise")),
    ("extra None", lambda cs: cs["extra"]["centre_var"].__setitem__(1, None)),
]


def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("fault", [f for f, _ in TORCH_FAULTS], ids=[f for f, _ in TORCH_FAULTS])
def test_the_message_is_the_torch_loaders(fault):
    torch = _torch()
    adaclip_torch = pytest.importorskip("adaclip_torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = adaclip_torch.AdaClip(
        torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=SIGMA, expected_batch_size=BBAR,
        correction="unbiased", pooling="factored", update_every=3, centre="kalman", quantile=S.QuantileRule(),
    )  # fmt: skip
    strategy = opt.strategy
    like = opt.clip_state
    sd = opt.state_dict()
    cs = sd["clip_state"]
    state = S.ClipState(step=cs["step"], mean=cs["mean"], std=cs["std"], extra=cs["extra"])
    strategy.check_state(state, like, names=opt.param_names, asarray=torch.as_tensor)  # the control
    dict(TORCH_FAULTS)[fault](cs)
    with pytest.raises(InvalidHyperparameterError) as from_torch:
        opt.load_state_dict(sd)
    state = S.ClipState(step=cs["step"], mean=cs["mean"], std=cs["std"], extra=cs["extra"])
    with pytest.raises(InvalidHyperparameterError) as from_core:
        strategy.check_state(state, like, names=opt.param_names, asarray=torch.as_tensor)
    assert str(from_core.value) == str(from_torch.value)
