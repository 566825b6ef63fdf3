"""The per-sample engines of adaclip_torch.engines: which one an optimizer gets, and that they agree.

The engines' numbers are checked in depth elsewhere (test_torch_ghost: ghost against
materialised; test_torch_kernel: kernels against the core); here: :func:`make_engine` picks
the engine of ``per_sample_mode`` / ``use_kernel``, the materialised and ghost engines give the
same clipped sums on one batch, and ``DPOptimizer.engine`` cannot be replaced.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from adaclip import strategies
from adaclip.errors import InvalidHyperparameterError
from adaclip_torch import AdaClip, FlatClip
from adaclip_torch.engines import (
    EngineContext,
    GhostEngine,
    KernelEngine,
    MaterialisedEngine,
    StepInputs,
    make_engine,
)
from adaclip_torch.grad_sample import GradSampleHooks
from adaclip_torch.kernels import kernel_available

DT = torch.float64


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(DT)


def context(model: nn.Module) -> EngineContext:
    names, params = zip(*model.named_parameters(), strict=True)
    return EngineContext(params, names, tuple(tuple(p.shape) for p in params), DT)


@pytest.mark.parametrize(
    "mode,engine_type", [("materialise", MaterialisedEngine), ("ghost", GhostEngine), ("auto", GhostEngine)]
)
def test_make_engine_picks_the_engine_of_the_mode(mode, engine_type):
    model = mlp()
    # without hooks nothing can capture a ghost layer's calls: every mode reads p.grad_sample
    assert type(make_engine(mode, context(model), model=model)) is MaterialisedEngine
    with GradSampleHooks(model) as hooks:
        engine = make_engine(mode, context(model), model=model, hooks=hooks)
        assert type(engine) is engine_type and not engine.fuses_release
        if engine_type is GhostEngine:
            assert engine.modules == {model[0]: "linear", model[2]: "linear"}
    # the fused kernels: their own engine, which releases itself; only on materialised gradients
    engine = make_engine("materialise", context(model), model=model, use_kernel=True)
    assert type(engine) is KernelEngine and engine.fuses_release
    with pytest.raises(InvalidHyperparameterError, match="per_sample_mode='materialise'"):
        make_engine(mode if mode != "materialise" else "auto", context(model), model=model, use_kernel=True)
    with pytest.raises(InvalidHyperparameterError, match="per_sample_mode must be one of"):
        make_engine("plain", context(model), model=model)
    # and through the optimizer
    opt = FlatClip(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        per_sample_mode=mode,
    )
    assert type(opt.engine) is engine_type and not opt.fused_kernels


def test_optimizer_with_use_kernel_gets_the_kernel_engine():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not kernel_available(torch.device(device)):
        pytest.skip(
            "the Triton kernels cannot run here (on CPU they need TRITON_INTERPRET=1 before triton is imported)"
        )
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    opt = FlatClip(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        max_grad_norm=1.0,
        noise_multiplier=1.0,
        expected_batch_size=4.0,
        use_kernel=True,
    )
    assert type(opt.engine) is KernelEngine and opt.fused_kernels


def _batch_sums(opt: AdaClip | FlatClip, model: nn.Module, x: torch.Tensor, y: torch.Tensor, state) -> list:
    """The engine's clipped sums of one batch, clipped with ``state``; and the sources."""
    nn.functional.cross_entropy(model(x), y).backward()
    inputs = StepInputs(state, lambda s: s.transform(state, len(opt.params)), "zero", opt.grad_sample_hooks)
    sources = opt.engine.unit_sources(inputs, require=True)
    return opt.engine.clipped_sum(inputs, opt.strategy, sources), sources


@pytest.mark.parametrize("strategy", ["flat", "adaptive"])
def test_materialised_and_ghost_engines_give_the_same_clipped_sums(strategy):
    base = mlp()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, 5, generator=gen, dtype=DT), torch.randint(0, 3, (9,), generator=gen)
    sums, kinds = {}, {}
    state = None
    for mode in ("materialise", "ghost"):
        model = copy.deepcopy(base)
        common = dict(noise_multiplier=1.0, expected_batch_size=9.0, per_sample_mode=mode, seed=0)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if strategy == "flat":
            opt = FlatClip(sgd, model, max_grad_norm=0.05, **common)  # every unit clipped
        else:
            opt = AdaClip(sgd, model, std_min=1e-3, std_max=0.05, **common, preset="patent")
        assert isinstance(
            opt.strategy, strategies.FlatClipping if strategy == "flat" else strategies.AdaptiveClipping
        )
        if state is None:  # one state for both, with a centre away from 0 (AdaCliP)
            state = opt.clip_state
            if state.mean is not None:
                state = state._replace(
                    mean=[torch.randn(m.shape, generator=gen, dtype=DT) for m in state.mean]
                )
        sums[mode], sources = _batch_sums(opt, model, x, y, state)
        kinds[mode] = {type(s).__name__ for s in sources}
    assert kinds == {"materialise": {"Tensor"}, "ghost": {"tuple"}}  # every Linear tensor: a ghost pair
    assert len(sums["ghost"]) == len(sums["materialise"]) == 4
    for g, m in zip(sums["ghost"], sums["materialise"], strict=True):
        assert float(m.abs().max()) > 0
        torch.testing.assert_close(g, m, rtol=1e-5, atol=1e-12)


def test_engine_is_read_only():
    model = mlp()
    opt = FlatClip(
        torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=4.0,
        per_sample_mode="materialise",
    )
    engine = opt.engine
    other = make_engine("materialise", context(model), model=model)
    with pytest.raises(AttributeError):
        opt.engine = other
    with pytest.raises(AttributeError):
        del opt.engine
    assert opt.engine is engine and type(engine) is MaterialisedEngine
