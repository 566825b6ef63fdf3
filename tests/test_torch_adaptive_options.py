"""Every adaptive option through the PyTorch wrapper, on every per-sample path, against the core.

For each option set (AdaptiveClipping's centres, corrections, poolings, delayed statistics,
separated scale with and without the quantile rule, scale-then-privatize, QuantileClipping,
AutomaticClipping, and a combination) a DPOptimizer run equals
:func:`adaclip.strategies.private_step` on the same per-example gradients (one backward per
example on a twin model) and the same standard normals (a twin :class:`NoiseSource` with the
optimizer's seed: one draw per parameter tensor, then one 0-d draw per auxiliary sum), step by
step over 3 steps, parameters and the whole clip state (step, mean, std, extra) — on the
materialised, ghost, user-level, accumulate+step and empty-batch paths. Also: an invalid σ for
the quantile rule changes nothing, checkpoints carry the option state bit for bit and refuse a
corrupt one, the kernels are refused for non-patent options, the constructors and make_private
take the options, public statistics, and two gloo ranks equal one process.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
from _gloo import gloo_group, spawn_ranks
from test_torch_ghost import SeqModel, _data
from test_torch_opt_support import FakeAccountant, microbatch_per_example
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adaclip import strategies as S
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError, NoiseReplayWarning
from adaclip.schedules import ConstantSchedule, Retune, StepHyperparameters
from adaclip_torch import (
    AdaClip,
    AutomaticClip,
    DPOptimizer,
    FlatClip,
    NoiseSource,
    QuantileClip,
    make_private,
)

DT = torch.float64
SIGMA, BBAR, LR, SEED = 0.6, 5.0, 0.5, 7
BOUNDS = dict(std_min=1e-3, std_max=1.0)
RULE = S.QuantileRule(target_quantile=0.6, learning_rate=0.5, count_noise_multiplier=2.0)  # σ < 2σ_b = 4

OPTIONS = {
    "coupled_unbiased": lambda: S.AdaptiveClipping(**BOUNDS, correction="unbiased"),
    "tensor_pooling": lambda: S.AdaptiveClipping(**BOUNDS, pooling="tensor"),
    "factored_pooling": lambda: S.AdaptiveClipping(**BOUNDS, pooling="factored"),
    "update_every_3": lambda: S.AdaptiveClipping(**BOUNDS, update_every=3),
    "debiased_centre": lambda: S.AdaptiveClipping(**BOUNDS, centre="debiased"),
    "kalman_centre": lambda: S.AdaptiveClipping(**BOUNDS, centre="kalman", process_noise=0.05),
    "no_centre": lambda: S.AdaptiveClipping(**BOUNDS, centre="none"),
    "separated": lambda: S.AdaptiveClipping(**BOUNDS, scale="separated", max_grad_norm=1.0),
    "separated_quantile": lambda: S.AdaptiveClipping(**BOUNDS, scale="separated", max_grad_norm=1.0, quantile=RULE),
    "scale_then_privatize": lambda: S.AdaptiveClipping.scale_then_privatize(1.0, beta=0.9),
    "quantile_clipping": lambda: S.QuantileClipping(0.5, RULE),
    "automatic": lambda: S.AutomaticClipping(1.0, 0.05),
    "combined": lambda: S.AdaptiveClipping(
        **BOUNDS, scale="separated", max_grad_norm=0.8, shape_power=1.0, correction="unbiased",
        pooling="factored", update_every=2, centre="kalman", quantile=RULE,
    ),  # fmt: skip
}
PATHS = ("materialise", "ghost", "user", "accumulate", "empty")
USERS = torch.tensor([3, 1, 3, 2, 1, 0])

#: Every key ClipState.extra can hold, all in one strategy.
EVERY_EXTRA = dict(
    **BOUNDS, scale="separated", max_grad_norm=1.0, quantile=RULE, correction="unbiased",
    pooling="factored", update_every=3, centre="kalman",
)  # fmt: skip
EXTRA_KEYS = {"variance", "rows", "cols", "window_sum", "window_noise", "window_count", "centre_var", "clip_norm"}


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum(1).mean()


def _assert_state_equal(got: S.ClipState, want: S.ClipState, tol: float) -> None:
    assert int(got.step) == int(want.step)
    for key in ("mean", "std"):
        a, b = getattr(got, key), getattr(want, key)
        assert (a is None) == (b is None), key
        for x, y in zip(a or [], b or [], strict=True):
            torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    assert (got.extra is None) == (want.extra is None)
    assert set(got.extra or {}) == set(want.extra or {})
    for key, value in (want.extra or {}).items():
        mine = got.extra[key]
        if isinstance(value, list):
            assert len(mine) == len(value), key
            for x, y in zip(mine, value, strict=True):
                assert (x is None) == (y is None), key
                if y is not None:
                    torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=key)
        else:
            assert mine.ndim == 0
            torch.testing.assert_close(mine, value, rtol=tol, atol=tol, msg=key)


def _group(grads: list[torch.Tensor], users: torch.Tensor) -> list[torch.Tensor]:
    """Per-user sums, users in increasing id order (an independent loop, not the wrapper's)."""
    ids = sorted(set(users.tolist()))
    return [torch.stack([g[users == u].sum(0) for u in ids]) for g in grads]


def _batches(path: str) -> list[list[tuple]]:
    """Per logical step, the physical batches (the empty path's second step has none)."""
    gen = torch.Generator().manual_seed(3)
    if path == "accumulate":
        return [[_data("seq", a, gen), _data("seq", b, gen)] for a, b in ((3, 4), (2, 5), (4, 2))]
    if path == "user":
        return [[_data("seq", 6, gen)] for _ in range(3)]
    if path == "empty":
        return [[_data("seq", 5, gen)], [], [_data("seq", 4, gen)]]
    return [[_data("seq", n, gen)] for n in (5, 3, 6)]


def _run_against_core(option: str, path: str, *, tol: float = 1e-10) -> DPOptimizer:
    torch.manual_seed(0)
    model = SeqModel().to(DT)
    twin = copy.deepcopy(model)
    strategy = OPTIONS[option]()
    opt = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), model, strategy=strategy, noise_multiplier=SIGMA,
        expected_batch_size=BBAR, seed=SEED, per_sample_mode="ghost" if path == "ghost" else "materialise",
    )  # fmt: skip
    twin_params = list(twin.parameters())
    noise = NoiseSource(seed=SEED)
    state = strategy.init([p.detach() for p in twin_params])
    aux = [torch.zeros((), dtype=DT)] * strategy.num_auxiliary
    _assert_state_equal(opt.clip_state, state, 0.0)
    for physical in _batches(path):
        per_unit = [torch.zeros((0, *p.shape), dtype=DT) for p in twin_params]
        for j, (x, y) in enumerate(physical):
            _loss(model(x), y).backward()
            if path == "accumulate" and j == 0:
                opt.accumulate()
            grads = microbatch_per_example(twin, twin_params, _loss, x, y)
            per_unit = [torch.cat([a, g]) for a, g in zip(per_unit, grads, strict=True)]
        if path == "user":
            per_unit = _group(per_unit, USERS)
            opt.step(user_ids=USERS)
        else:
            opt.step(empty_batch=not physical)
        opt.zero_grad()
        z = noise.standard_normal([p.detach() for p in twin_params] + aux)
        released, state = S.private_step(strategy, state, per_unit, z, noise_multiplier=SIGMA,
                                         expected_batch_size=BBAR)
        with torch.no_grad():
            for p, g in zip(twin_params, released, strict=True):
                p.add_(g, alpha=-LR)
        for p, q in zip(model.parameters(), twin_params, strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=tol, atol=tol)
        _assert_state_equal(opt.clip_state, state, tol)
    assert opt.steps == 3
    assert torch.equal(opt.noise_source.get_state(), noise.get_state())  # the same number of draws
    return opt


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_every_option_on_every_path_equals_the_core(option, path):
    _run_against_core(option, path)


def test_the_options_set_what_they_should():
    """The option sets above are what they claim (and the quantile ones do adapt C_t)."""
    assert not any(OPTIONS[k]().is_patent for k in OPTIONS if isinstance(OPTIONS[k](), S.AdaptiveClipping))
    opt = _run_against_core("separated_quantile", "materialise")
    assert opt.strategy.num_auxiliary == 1
    c_t = float(opt.clip_state.extra["clip_norm"])
    assert c_t != 1.0 and opt.hyperparameters().max_grad_norm == pytest.approx(c_t)
    assert opt.hyperparameters(step=0).max_grad_norm is None  # a past C_t is not kept


# --------------------------------------------------------------------------- ghost: rank-one scales


def _rank_one_scale(out_f, in_f, gen, *, clamp_some=False, dtype=DT):
    """``b = √(r ⊗ c)``-like: a positive outer product (the factored pooling's form); with
    ``clamp_some`` a few coordinates moved off it (a clamp that bites)."""
    b = (torch.rand(out_f, 1, generator=gen, dtype=dtype) + 0.2) * (torch.rand(1, in_f, generator=gen, dtype=dtype) + 0.2)
    if clamp_some:
        b = b.clone()
        b[0, -1] = b[0, -1] * 3.0
    return b


@pytest.mark.parametrize("seq", [2, 5])
@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("mode", ["ghost", "auto"])
@pytest.mark.parametrize("clamp_some", [False, True])
def test_ghost_rank_one_scale_norms_equal_materialised(seq, centred, mode, clamp_some, monkeypatch):
    from adaclip import transform
    from adaclip_torch import ghost

    calls = []
    exact = ghost.GhostLayer._exact
    monkeypatch.setattr(ghost.GhostLayer, "_exact", lambda self, *a: calls.append(1) or exact(self, *a))
    gen = torch.Generator().manual_seed(seq + 10 * centred)
    in_f, out_f, n = 7, 6, 5
    x = torch.randn(n, seq, in_f, generator=gen, dtype=DT)
    e = torch.randn(n, seq, out_f, generator=gen, dtype=DT)
    ref = torch.einsum("nto,ntk->nok", e, x)
    scale = _rank_one_scale(out_f, in_f, gen, clamp_some=clamp_some)
    centre = torch.randn(out_f, in_f, generator=gen, dtype=DT) * 0.3 if centred else None
    layer = ghost.GhostLayer(nn.Linear(in_f, out_f).to(DT), "linear", [(x, e)], DT, mode)
    got = layer.norm("weight", centre, scale)
    want = transform.transformed_sq_norms([ref], None if centre is None else [centre], [scale])[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert bool((got >= want * (1 - 1e-15)).all())  # an upper bound, up to the reference's own rounding
    cheap = mode == "ghost" or seq * (in_f + out_f) <= in_f * out_f
    assert bool(calls) == (clamp_some or not cheap)  # the Gram form, unless the scale is not rank one


def test_ghost_rank_one_float32_never_under_clips_with_a_large_centre():
    """The centred Gram expansion cancels when ‖a/b‖ ≫ ‖(g − a)/b‖: its bound stays above the
    float64 norm (loose units are recomputed exactly)."""
    from adaclip import transform
    from adaclip_torch import ghost

    gen = torch.Generator().manual_seed(1)
    n, seq, in_f, out_f = 16, 4, 20, 10
    x = torch.randn(n, seq, in_f, generator=gen, dtype=DT)
    e = torch.randn(n, seq, out_f, generator=gen, dtype=DT) * 1e-2
    ref = torch.einsum("nto,ntk->nok", e, x)
    scale = _rank_one_scale(out_f, in_f, gen) * 1e-2
    for ratio in (1e2, 1e4):
        centre = ref.mean(0) + ratio * scale * torch.randn(out_f, in_f, generator=gen, dtype=DT) / math.sqrt(in_f * out_f)
        want = transform.transformed_sq_norms([ref], [centre], [scale])[0]
        f32 = torch.float32
        layer = ghost.GhostLayer(nn.Linear(in_f, out_f), "linear", [(x.to(f32), e.to(f32))], f32, "ghost")
        got = layer.norm("weight", centre.to(f32), scale.to(f32)).to(DT)
        assert bool((got >= want).all()), float((want - got).max())
        assert float((got / want).max()) < 1.05


def test_factored_pooling_ghost_run_takes_the_gram_form(monkeypatch):
    from adaclip_torch.grad_sample import linear

    taken = []
    rank_one = linear.rank_one
    monkeypatch.setattr(linear, "rank_one", lambda d: taken.append(rank_one(d) is not None) or rank_one(d))
    _run_against_core("factored_pooling", "ghost")
    assert taken and all(taken)  # SeqModel's sequence Linear, every step: no clamp bites here


# --------------------------------------------------------------------------- σ for the quantile rule


class _StepUp:
    """σ = 0.5 at step 0, then 3.0 (beyond 2σ_b = 2 for σ_b = 1)."""

    def at(self, step: int) -> StepHyperparameters:
        return StepHyperparameters(0.5 if step == 0 else 3.0)


def _snapshot(model, opt):
    sd = opt.state_dict()
    return ([p.detach().clone() for p in model.parameters()], sd["clip_state"], opt.steps,
            opt.noise_source.get_state().clone(), list(opt.accountant.history))  # fmt: skip


def _same_snapshot(a, b) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    assert a[2] == b[2] and torch.equal(a[3], b[3]) and a[4] == b[4]
    _assert_state_equal(S.ClipState(**a[1]), S.ClipState(**b[1]), 0.0)


@pytest.mark.parametrize("cls, kw", [
    (QuantileClip, dict(max_grad_norm=0.5, count_noise_multiplier=1.0)),
    (AdaClip, dict(scale="separated", max_grad_norm=0.5, quantile=S.QuantileRule(count_noise_multiplier=1.0))),
])  # fmt: skip
def test_bad_sigma_for_the_quantile_rule_raises_and_changes_nothing(cls, kw):
    torch.manual_seed(0)
    model = SeqModel().to(DT)
    opt = cls(torch.optim.SGD(model.parameters(), lr=LR), model, noise_schedule=_StepUp(), expected_batch_size=BBAR,
              seed=1, accountant=FakeAccountant(10), sample_rate=0.1, **kw)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    _loss(model(_data("seq", 4, gen)[0]), torch.zeros(4, 3, dtype=DT)).backward()
    opt.step()
    opt.zero_grad()
    x, y = _data("seq", 4, gen)
    _loss(model(x), y).backward()
    before = _snapshot(model, opt)
    for call in (opt.step, opt.accumulate, lambda: opt.step(empty_batch=True)):
        with pytest.raises(InvalidHyperparameterError, match="count_noise_multiplier"):
            call()
        _same_snapshot(_snapshot(model, opt), before)
    assert opt.accountant.history == [(0.5, 0.1)]  # the accounted σ, not σ_g


def test_bad_sigma_is_refused_at_construction_before_hooks():
    model = SeqModel().to(DT)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(InvalidHyperparameterError, match=r"σ = 1 and σ_b = 0.4"):
        QuantileClip(sgd, model, noise_multiplier=1.0, expected_batch_size=8.0)  # σ_b = B̄/20 = 0.4
    opt = QuantileClip(sgd, model, noise_multiplier=1.0, expected_batch_size=8.0, count_noise_multiplier=1.0)
    assert opt.grad_sample_hooks is not None  # no hooks were left behind by the refusal


def test_a_schedule_sets_the_separated_scales_fixed_clip_norm():
    model = SeqModel().to(DT)
    schedule = Retune(ConstantSchedule(0.5), at_step=2, max_grad_norm=0.3)
    sep = AdaClip(torch.optim.SGD(model.parameters(), lr=LR), model, noise_schedule=schedule, expected_batch_size=BBAR,
                  scale="separated", max_grad_norm=1.0, attach_hooks=False, preset="patent")  # fmt: skip
    assert sep.hyperparameters(step=2).max_grad_norm == 0.3 and sep.hyperparameters().max_grad_norm == 1.0
    assert sep._strategy_at(2).max_grad_norm == 0.3


def test_a_schedule_setting_the_clip_norm_of_the_quantile_rule_is_refused():
    model = SeqModel().to(DT)
    with pytest.raises(InvalidHyperparameterError, match="quantile rule"):
        QuantileClip(torch.optim.SGD(model.parameters(), lr=LR), model, noise_schedule=ConstantSchedule(0.5, 0.3),
                     expected_batch_size=BBAR, count_noise_multiplier=1.0, attach_hooks=False)  # fmt: skip


# --------------------------------------------------------------------------- checkpoints


def _every_extra_optimizer(seed: int = 5):
    torch.manual_seed(0)
    model = SeqModel().to(DT)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=LR), model, noise_multiplier=SIGMA, expected_batch_size=BBAR,
                  seed=seed, **EVERY_EXTRA, preset="patent")  # fmt: skip
    return model, opt


def _steps(model, opt, seeds):
    for s in seeds:
        x, y = _data("seq", 5, torch.Generator().manual_seed(s))
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_state_dict_round_trip_with_every_extra_key_is_bit_for_bit():
    model, opt = _every_extra_optimizer()
    assert set(opt.clip_state.extra) == EXTRA_KEYS
    _steps(model, opt, (0, 1))  # mid-window (window_count = 2), Kalman observed, C_t moved
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    model2, opt2 = _every_extra_optimizer(seed=5)
    model2.load_state_dict(model.state_dict())
    with pytest.warns(NoiseReplayWarning):
        opt2.load_state_dict(saved)
    _assert_state_equal(opt2.clip_state, opt.clip_state, 0.0)
    assert float(opt2.clip_state.extra["window_count"]) == 2.0
    _steps(model, opt, (2, 3))
    _steps(model2, opt2, (2, 3))
    _assert_state_equal(opt2.clip_state, opt.clip_state, 0.0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters(), strict=True))


def _edit_extra(key, how):
    def edit(extra):
        value = extra[key]
        k = next(i for i, v in enumerate(value) if v is not None) if isinstance(value, list) else None
        if how == "drop":
            extra.pop(key)
        elif how == "shape":
            value[k] = torch.zeros(7, dtype=DT)
        elif how == "none":
            value[k] = None
        elif how == "tensor_for_none":
            value[value.index(None)] = torch.zeros(3, dtype=DT)
        elif how == "short":
            value.pop()
        elif isinstance(value, list):
            value[k] = torch.full_like(value[k], how)
        else:
            extra[key] = torch.tensor(how, dtype=DT)
    return edit


@pytest.mark.parametrize("edit, words", [
    (_edit_extra("variance", "drop"), r"missing \['variance'\]"),
    (lambda e: e.__setitem__("bogus", torch.zeros(())), r"unexpected \['bogus'\]"),
    (_edit_extra("rows", "shape"), "has shape"),
    (_edit_extra("cols", float("nan")), "NaN or inf"),
    (_edit_extra("variance", "none"), "is None, expected a tensor"),
    (_edit_extra("variance", "tensor_for_none"), "expected None"),
    (_edit_extra("window_sum", "short"), "list of"),
    (_edit_extra("window_sum", float("inf")), "NaN or inf"),
    (_edit_extra("window_noise", -1.0), ">= 0"),
    (_edit_extra("window_count", 2.5), "whole number"),
    (_edit_extra("window_count", 3.0), "whole number"),
    (_edit_extra("window_count", float("nan")), "NaN or inf"),
    (_edit_extra("centre_var", -0.5), "or -1"),
    (_edit_extra("clip_norm", 0.0), "> 0"),
    (_edit_extra("clip_norm", float("inf")), "NaN or inf"),
])  # fmt: skip
def test_corrupt_option_state_is_refused_and_changes_nothing(edit, words):
    model, opt = _every_extra_optimizer()
    _steps(model, opt, (0,))
    sd = copy.deepcopy(opt.state_dict())
    edit(sd["clip_state"]["extra"])
    before = _snapshot_no_accountant(model, opt)
    with pytest.raises(InvalidHyperparameterError, match=words):
        opt.load_state_dict(sd)
    after = _snapshot_no_accountant(model, opt)
    assert after[1] == before[1] and torch.equal(after[2], before[2])
    _assert_state_equal(S.ClipState(**after[0]), S.ClipState(**before[0]), 0.0)


def _snapshot_no_accountant(model, opt):
    return opt.state_dict()["clip_state"], opt.steps, opt.noise_source.get_state().clone()


def test_option_state_of_another_strategy_is_refused():
    model, opt = _every_extra_optimizer()
    sd = copy.deepcopy(opt.state_dict())
    sd["clip_state"]["extra"] = None  # e.g. a checkpoint of the patent's AdaCliP
    with pytest.raises(InvalidHyperparameterError, match="must be a dict"):
        opt.load_state_dict(sd)
    flat_model = SeqModel().to(DT)
    flat = FlatClip(torch.optim.SGD(flat_model.parameters(), lr=LR), flat_model, noise_multiplier=SIGMA,
                    expected_batch_size=BBAR)  # fmt: skip
    sd = flat.state_dict()
    assert sd["clip_state"]["extra"] is None
    flat.load_state_dict(copy.deepcopy(sd))  # an old checkpoint without the key loads too
    sd["clip_state"].pop("extra")
    flat.load_state_dict(sd)
    sd["clip_state"]["extra"] = {"clip_norm": torch.tensor(1.0)}
    with pytest.raises(InvalidHyperparameterError, match="keeps none"):
        flat.load_state_dict(sd)


def test_quantile_clipping_state_round_trips():
    torch.manual_seed(0)
    model = SeqModel().to(DT)
    opt = QuantileClip(torch.optim.SGD(model.parameters(), lr=LR), model, noise_multiplier=SIGMA,
                       expected_batch_size=BBAR, count_noise_multiplier=2.0, seed=3)  # fmt: skip
    _steps(model, opt, (0, 1))
    sd = opt.state_dict()
    assert set(sd["clip_state"]["extra"]) == {"clip_norm"} and sd["clip_state"]["std"] is None
    model2 = SeqModel().to(DT)
    opt2 = QuantileClip(torch.optim.SGD(model2.parameters(), lr=LR), model2, noise_multiplier=SIGMA,
                        expected_batch_size=BBAR, count_noise_multiplier=2.0, seed=3)  # fmt: skip
    with pytest.warns(NoiseReplayWarning):
        opt2.load_state_dict(sd)
    assert torch.equal(opt2.clip_state.extra["clip_norm"], opt.clip_state.extra["clip_norm"])
    assert opt2.hyperparameters().max_grad_norm == opt.hyperparameters().max_grad_norm != 0.5


# --------------------------------------------------------------------------- kernels, warnings


def test_kernels_are_refused_for_non_patent_options_naming_them():
    model = nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    common = dict(noise_multiplier=1.0, expected_batch_size=4.0, use_kernel=True)
    with pytest.raises(InvalidHyperparameterError, match=r"is_patent.*pooling='factored'"):
        AdaClip(sgd, model, pooling="factored", **common, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="QuantileClipping.*auxiliary sums"):
        QuantileClip(sgd, model, count_noise_multiplier=1.0, **common)
    with pytest.raises(InvalidHyperparameterError, match="AutomaticClipping"):
        AutomaticClip(sgd, model, **common)
    # auto mode takes the core path for them (and on this CPU machine for everything)
    for kw in (dict(centre="kalman"), dict(scale="separated", max_grad_norm=1.0)):
        assert not AdaClip(sgd, model, noise_multiplier=1.0, expected_batch_size=4.0, attach_hooks=False,
                           **kw, preset="patent").fused_kernels  # fmt: skip


def test_noise_drift_warning_only_for_the_coupled_scale():
    from adaclip.errors import NoiseDominatedWarning

    model = nn.Linear(60, 40)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    common = dict(noise_multiplier=1.0, expected_batch_size=4.0, attach_hooks=False)
    with pytest.warns(NoiseDominatedWarning):
        AdaClip(sgd, model, correction="unbiased", **common, preset="patent")
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseDominatedWarning)
        AdaClip(sgd, model, scale="separated", max_grad_norm=1.0, **common, preset="patent")
        QuantileClip(sgd, model, count_noise_multiplier=1.0, **common)


# --------------------------------------------------------------------------- constructors


def test_adaclip_passes_every_option_through():
    model = SeqModel().to(DT)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    opts = dict(scale="separated", max_grad_norm=0.7, shape_power=1.0, statistic="second_moment",
                correction="none", pooling="tensor", update_every=4, centre="debiased", process_noise=0.2,
                freeze_statistics=True, quantile=RULE)  # fmt: skip
    opt = AdaClip(sgd, model, noise_multiplier=SIGMA, expected_batch_size=BBAR, attach_hooks=False, beta_std=0.8,
                  **BOUNDS, **opts, preset="patent")  # fmt: skip
    assert opt.strategy == S.AdaptiveClipping(**BOUNDS, beta_std=0.8, **opts)


def test_adaclip_initial_clip_with_the_separated_scale():
    model = SeqModel().to(DT)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    d = sum(p.numel() for p in model.parameters())
    common = dict(noise_multiplier=SIGMA, expected_batch_size=BBAR, attach_hooks=False)
    opt = AdaClip(sgd, model, initial_max_grad_norm=0.4, scale="separated", **common, preset="patent")
    s = opt.strategy
    assert s.max_grad_norm == 0.4 and math.sqrt(s.std_min * s.std_max) == pytest.approx(0.4 / math.sqrt(d))
    coupled = AdaClip(sgd, model, initial_max_grad_norm=0.4, centre="kalman", **common, preset="patent").strategy
    assert coupled == S.AdaptiveClipping.from_initial_clip(0.4, d, centre="kalman")
    with pytest.raises(InvalidHyperparameterError, match="max_grad_norm or initial_max_grad_norm, not both"):
        AdaClip(sgd, model, initial_max_grad_norm=0.4, max_grad_norm=0.4, scale="separated", **common, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="initial_max_grad_norm=C0, or use the default preset"):
        AdaClip(sgd, model, max_grad_norm=0.4, **common, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="needs max_grad_norm"):
        AdaClip(sgd, model, scale="separated", **common, preset="patent")
    with pytest.raises(InvalidHyperparameterError, match="pooling must be one of"):
        AdaClip(sgd, model, pooling="rows", **common, preset="patent")


def test_quantile_and_automatic_wrappers_build_their_strategies():
    model = SeqModel().to(DT)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    common = dict(noise_multiplier=SIGMA, expected_batch_size=BBAR, attach_hooks=False)
    q = QuantileClip(sgd, model, max_grad_norm=0.3, target_quantile=0.7, clip_learning_rate=0.1,
                     count_noise_multiplier=2.5, **common)  # fmt: skip
    assert q.strategy == S.QuantileClipping(0.3, S.QuantileRule(0.7, 0.1, 2.5))
    assert q.hyperparameters() == (SIGMA, 0.3)
    a = AutomaticClip(sgd, model, max_grad_norm=2.0, stability=0.1, **common)
    assert a.strategy == S.AutomaticClipping(2.0, 0.1) and a.hyperparameters() == (SIGMA, 2.0)
    with pytest.raises(InvalidHyperparameterError, match="target_quantile"):
        QuantileClip(sgd, model, target_quantile=1.5, **common)
    with pytest.raises(InvalidHyperparameterError, match="stability"):
        AutomaticClip(sgd, model, stability=0.0, **common)


# --------------------------------------------------------------------------- public statistics


def _public_grads(model, n=6, seed=9):
    x, y = _data("seq", n, torch.Generator().manual_seed(seed))
    return microbatch_per_example(model, list(model.parameters()), _loss, x, y)


def test_public_statistics_replace_the_state_as_the_core_does():
    torch.manual_seed(0)
    model = SeqModel().to(DT)
    public = _public_grads(model)  # before wrapping: no hooks see these backward passes
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=LR), model, noise_multiplier=SIGMA, expected_batch_size=BBAR,
                  seed=1, scale="separated", max_grad_norm=1.0, pooling="factored", freeze_statistics=True,
                  **BOUNDS, preset="patent")  # fmt: skip
    want = opt.strategy.with_public_statistics(opt.clip_state, public, weight=0.7)
    opt.use_public_statistics(public, weight=0.7)
    _assert_state_equal(opt.clip_state, want, 0.0)
    frozen = [s.clone() for s in opt.clip_state.std]
    _steps(model, opt, (0,))
    assert all(torch.equal(a, b) for a, b in zip(opt.clip_state.std, frozen, strict=True))  # frozen statistics


def test_public_statistics_are_validated_and_change_nothing_on_refusal():
    torch.manual_seed(0)
    model = SeqModel().to(DT)
    public = _public_grads(model)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=LR), model, noise_multiplier=SIGMA, expected_batch_size=BBAR,
                  seed=1, **BOUNDS, preset="patent")  # fmt: skip
    state = opt.clip_state
    bad_nan = [g.clone() for g in public]
    bad_nan[0][0, 0, 0] = float("nan")
    for grads, err, words in [
        (public[:-1], InvalidGradientError, "expected 5"),
        ([public[0][:, :2]] + public[1:], InvalidGradientError, "shape"),
        (bad_nan, InvalidGradientError, "NaN"),
        ([g[:1] for g in public], InvalidHyperparameterError, "at least 2"),
        (public[0], InvalidGradientError, "list"),
    ]:
        with pytest.raises(err, match=words):
            opt.use_public_statistics(grads)
        assert opt.clip_state is state
    with pytest.raises(InvalidHyperparameterError, match="weight"):
        opt.use_public_statistics(public, weight=1.5)
    x, y = _data("seq", 3, torch.Generator().manual_seed(0))
    _loss(model(x), y).backward()
    opt.accumulate()
    with pytest.raises(InvalidGradientError, match="accumulate"):
        opt.use_public_statistics(public)
    assert opt.clip_state is state
    flat_model = SeqModel().to(DT)
    flat = FlatClip(torch.optim.SGD(flat_model.parameters(), lr=LR), flat_model, noise_multiplier=SIGMA,
                    expected_batch_size=BBAR)  # fmt: skip
    with pytest.raises(InvalidHyperparameterError, match="AdaptiveClipping"):
        flat.use_public_statistics(public)


# --------------------------------------------------------------------------- make_private


def _private_parts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=40)  # B̄ = 40


def _train_one_epoch(model, opt, loader):
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_make_private_quantile_and_automatic():
    model, opt, loader = _private_parts()
    model, priv, loader = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=0.5,
                                       strategy="quantile", target_quantile=0.7, seed=0)  # fmt: skip
    assert isinstance(priv, QuantileClip)
    assert priv.strategy == S.QuantileClipping(0.5, S.QuantileRule(target_quantile=0.7))  # σ_b = B̄/20 = 2 > σ/2
    _train_one_epoch(model, priv, loader)
    assert priv.accountant.history == ((pytest.approx(0.2), 1.0, 5),)  # the accounted σ
    assert priv.hyperparameters().max_grad_norm != 0.5
    model, opt, loader = _private_parts()
    _, auto, _ = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=2.0, strategy="automatic",
                              stability=0.1)  # fmt: skip
    assert isinstance(auto, AutomaticClip) and auto.strategy == S.AutomaticClipping(2.0, 0.1)


def test_make_private_adaclip_takes_the_options():
    model, opt, loader = _private_parts()
    d = sum(p.numel() for p in model.parameters())
    model, priv, loader = make_private(
        model, opt, loader, noise_multiplier=1.0, max_grad_norm=0.5, strategy="adaclip", scale="separated", pooling="factored",
        centre="kalman", update_every=2, quantile=S.QuantileRule(count_noise_multiplier=3.0), seed=0,
    )  # fmt: skip
    s = priv.strategy
    assert (s.scale, s.max_grad_norm, s.pooling, s.centre, s.update_every) == ("separated", 0.5, "factored", "kalman", 2)
    assert math.sqrt(s.std_min * s.std_max) == pytest.approx(0.5 / math.sqrt(d))
    _train_one_epoch(model, priv, loader)
    assert priv.steps == 5 and all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("kwargs, words", [
    (dict(strategy="quantile", noise_multiplier=1.0, count_noise_multiplier=0.4), "does not suit strategy 'quantile'"),
    (dict(strategy="quantile", noise_multiplier=5.0), "σ_b = 2"),  # B̄/20
    (dict(strategy="adaclip", noise_multiplier=1.0, pooling="rows"), "pooling must be one of"),
    (dict(strategy="adaclip", noise_multiplier=1.0, quantile=S.QuantileRule(), preset="patent"), "separated"),
    (dict(strategy="automatic", noise_multiplier=1.0, stability=-1.0), "stability"),
    (dict(strategy="automatic", noise_multiplier=1.0, target_quantile=0.5), "takes no keyword 'target_quantile'"),
    (dict(strategy="flat", noise_multiplier=1.0, pooling="tensor"), "takes no keyword 'pooling'"),
])  # fmt: skip
def test_make_private_refuses_bad_options_before_building(kwargs, words):
    model, opt, loader = _private_parts()
    with pytest.raises(InvalidHyperparameterError, match=words):
        make_private(model, opt, loader, **kwargs)
    assert not hasattr(model[0].weight, "grad_sample")
    AdaClip(opt, model, noise_multiplier=1.0, expected_batch_size=8.0, preset="patent")  # no hooks were left behind


# --------------------------------------------------------------------------- two gloo ranks

WORLD = 2
DDP_STRATEGY = "combined"


def _ddp_run(rank: int, world: int, distributed: bool) -> tuple[list[torch.Tensor], S.ClipState]:
    """Three steps: both ranks' shards; rank 0 the whole batch and rank 1 an empty one;
    accumulate one half then step the other (a single process sees the whole batches)."""
    torch.manual_seed(0)
    model = SeqModel().to(DT)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, strategy=OPTIONS[DDP_STRATEGY](),
                      noise_multiplier=SIGMA, expected_batch_size=BBAR, seed=SEED if rank == 0 else 100 + rank,
                      distributed=distributed)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    x, y = _data("seq", 6, gen)
    _loss(model(x[rank::world]), y[rank::world]).backward()
    opt.step()
    opt.zero_grad()
    x, y = _data("seq", 5, gen)
    if rank == 0:
        _loss(model(x), y).backward()
        opt.step()
    else:
        opt.step(empty_batch=True)
    opt.zero_grad()
    x, y = _data("seq", 8, gen)
    first, second = (x[:4], y[:4]), (x[4:], y[4:])
    for j, (xs, ys) in enumerate((first, second)):
        _loss(model(xs[rank::world]), ys[rank::world]).backward()
        if j == 0:
            opt.accumulate()
        else:
            opt.step()
    opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt.clip_state


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    with gloo_group(rank, world, init_file):
        params, state = _ddp_run(rank, world, True)
        torch.save({"params": params, "state": state._asdict()}, f"{out_dir}/rank{rank}.pt")


def test_two_ranks_release_what_one_process_releases(tmp_path):
    """Rank 0 adds σ_g·z to the tensors and σ_aux·z to the count (the same draws a single
    process makes with that seed); the ranks agree, and equal one process on the union."""
    ranks = spawn_ranks(_ddp_worker, tmp_path, WORLD, WORLD)
    params, state = _ddp_run(0, 1, False)
    for r in ranks:
        for p, q in zip(r["params"], params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        _assert_state_equal(S.ClipState(**r["state"]), state, 1e-10)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True))
