"""A clipping strategy the library has never seen runs through the front ends unchanged.

The strategy is defined here, against the :class:`adaclip.mechanism.Strategy` protocol only: a
centre that is the running mean of the *released* gradients (post-processing: the state moves
on the release alone), scale ``C``, the whole vector clipped to radius 1. The core's
:func:`adaclip.mechanism.private_step` on NumPy arrays decides; the PyTorch optimizer (same
per-example gradients, same standard normals) and the JAX transformation (no noise, so the
draws need not be shared) must give the same releases over several steps, state included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from adaclip import transform
from adaclip._array import namespace
from adaclip.mechanism import ClipState, private_step

STEPS, BATCH, D_IN, D_OUT = 4, 5, 3, 2


class ReleasedMeanCentre:
    """``a_t`` = an exponential moving average (decay ``beta``) of the released gradients,
    ``b = C``, one clip group of radius 1. Every unit's transformed contribution has norm at
    most 1, so a step is the Gaussian mechanism with sensitivity 1; the centre depends on past
    releases only."""

    num_auxiliary = 0

    def __init__(self, max_grad_norm: float = 0.5, beta: float = 0.5) -> None:
        self.max_grad_norm, self.beta = max_grad_norm, beta

    def init(self, params: Sequence[Any]) -> ClipState:
        xp = namespace(*params)
        return ClipState(step=0, mean=[xp.zeros_like(p) for p in params])

    def transform(self, state: ClipState, num_tensors: int) -> tuple[list[Any], list[float]]:
        return list(state.mean), [self.max_grad_norm] * num_tensors

    def clip_groups(self, num_tensors: int) -> list[tuple[list[int], float]]:
        return [(list(range(num_tensors)), 1.0)]

    def clip_factors(self, sq_norm: Any, radius: float) -> Any:
        return transform.clip_factors(sq_norm, radius)

    def auxiliary_sums(self, state: ClipState, sq_norms: Any, factors: Any) -> list[Any]:
        return []

    def noise_multipliers(self, noise_multiplier: Any, expected_batch_size: Any) -> tuple[Any, Any]:
        return noise_multiplier, 0.0

    def update(self, state, noisy_grad, scale, *, auxiliary=(), noise_multiplier, expected_batch_size) -> ClipState:
        mean = [self.beta * m + (1.0 - self.beta) * g for m, g in zip(state.mean, noisy_grad, strict=True)]
        return ClipState(step=state.step + 1, mean=mean, std=state.std, extra=state.extra)


def _batches(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Inputs ``x`` and the loss's output weights ``u`` (loss ``Σ_i <W x_i, u_i>``: the
    per-example gradient of ``W`` is ``u_i x_iᵀ``), large enough that clipping binds."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(BATCH, D_IN)), 2.0 * rng.normal(size=(BATCH, D_OUT))) for _ in range(STEPS)]


def _per_example(x: np.ndarray, u: np.ndarray) -> np.ndarray:
    return np.einsum("no,ni->noi", u, x)


def _reference(noise: list[np.ndarray] | None, sigma: float) -> list[np.ndarray]:
    strategy = ReleasedMeanCentre()
    state, out = strategy.init([np.zeros((D_OUT, D_IN))]), []
    for t, (x, u) in enumerate(_batches()):
        released, state = private_step(strategy, state, [_per_example(x, u)], None if noise is None else [noise[t]],
                                       noise_multiplier=sigma, expected_batch_size=BATCH)  # fmt: skip
        out.append(released[0])
    return out


@pytest.mark.torch
def test_a_new_strategy_runs_through_the_torch_optimizer():
    import torch
    from torch import nn

    from adaclip_torch import DPOptimizer
    from adaclip_torch.noise import NoiseSource

    sigma, seed = 0.7, 5
    source = NoiseSource(seed=seed)
    noise = [source.standard_normal([torch.zeros(D_OUT, D_IN)])[0].double().numpy() for _ in range(STEPS)]
    expected = _reference(noise, sigma)
    assert not np.allclose(expected[1], expected[0])  # the centre moved: the state is exercised

    model = nn.Linear(D_IN, D_OUT, bias=False)
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, strategy=ReleasedMeanCentre(),
                      noise_multiplier=sigma, expected_batch_size=BATCH, loss_reduction="sum", seed=seed)  # fmt: skip
    for t, (x, u) in enumerate(_batches()):
        out = model(torch.as_tensor(x, dtype=torch.float32))
        (out * torch.as_tensor(u, dtype=torch.float32)).sum().backward()
        opt.step()
        np.testing.assert_allclose(model.weight.grad.double().numpy(), expected[t], rtol=1e-5, atol=1e-6)
        opt.zero_grad()


@pytest.mark.jax
def test_a_new_strategy_runs_through_the_jax_transformation():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from adaclip_jax import private_aggregate

    expected = _reference(None, 0.0)
    tx = private_aggregate(ReleasedMeanCentre(), noise_multiplier=0.0, expected_batch_size=BATCH,
                           key=jax.random.PRNGKey(0))  # fmt: skip
    params = {"w": jnp.zeros((D_OUT, D_IN), jnp.float32)}
    state = tx.init(params)
    for t, (x, u) in enumerate(_batches()):
        grads = {"w": jnp.asarray(_per_example(x, u), jnp.float32)}
        released, state = tx.update(grads, state, params)
        np.testing.assert_allclose(np.asarray(released["w"], np.float64), expected[t], rtol=1e-5, atol=1e-6)
