"""JAX auditing: the one-run white-box ``GradientCanaryAuditor`` on the optax transformations."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import adaclip_jax  # noqa: E402
from adaclip.accounting import Accountant  # noqa: E402
from adaclip.errors import InvalidGradientError  # noqa: E402
from adaclip_jax.audit import GradientCanaryAuditor  # noqa: E402

pytestmark = pytest.mark.jax
DELTA = 1e-5


def params_like():
    return {"w": jnp.zeros((20, 24)), "b": jnp.zeros((24,)), "v": jnp.zeros((24, 3))}


def run(make_tx, *, sigma, steps=4, num_canaries=200, seed=0, masked_rows=0):
    """Full-batch (q = 1) steps of the transformation on random per-unit gradients + canaries."""
    params = params_like()
    tx = make_tx(sigma, seed)
    state = tx.init(params)
    auditor = GradientCanaryAuditor(tx, params, num_canaries=num_canaries, seed=seed, sample_rate=1.0)
    update = jax.jit(lambda g, s, m: tx.update(g, s, params, unit_mask=m))
    acc = Accountant("pld")
    rng = np.random.default_rng(seed)
    n = 16 + masked_rows
    for _ in range(steps):
        grads = jax.tree_util.tree_map(
            lambda p: jnp.asarray(0.05 + 0.1 * rng.standard_normal((n, *p.shape)), jnp.float32), params
        )
        mask = jnp.asarray(np.arange(n) < 16)
        grads, mask = auditor.insert(grads, state, unit_mask=mask)
        noisy, state = update(grads, state, mask)
        auditor.observe(noisy)
        acc.step(noise_multiplier=float(state.last_noise_multiplier), sample_rate=1.0)
    return auditor, acc


def adaclip_tx(sigma, seed):
    return adaclip_jax.adaclip(noise_multiplier=sigma, expected_batch_size=16, key=jax.random.key(seed),
                               initial_max_grad_norm=1.0)  # fmt: skip


def flat_tx(sigma, seed):
    return adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=sigma, expected_batch_size=16,
                                 key=jax.random.key(seed))  # fmt: skip


@pytest.mark.parametrize("make", [adaclip_tx, flat_tx], ids=["adaclip", "flat"])
def test_audit_stays_within_the_accountant(make):
    auditor, acc = run(make, sigma=2.0, masked_rows=3)  # √T/σ = 1
    rep = auditor.report(delta=DELTA, accountant=acc)
    assert not rep.exceeds_accountant, str(rep)
    assert rep.gdp.epsilon_lower <= rep.accountant_epsilon, str(rep)
    assert rep.gdp.mu > 0.5, str(rep)


def test_audit_detects_half_the_noise():
    _, claimed_acc = run(adaclip_tx, sigma=4.0, num_canaries=10)
    claimed = claimed_acc.epsilon(DELTA)
    auditor, _ = run(adaclip_tx, sigma=2.0, num_canaries=300, seed=1)
    rep = auditor.report(delta=DELTA)
    assert rep.gdp.epsilon_lower > claimed, (str(rep), claimed)


def test_audit_detects_no_noise():
    _, claimed_acc = run(flat_tx, sigma=4.0, num_canaries=10)
    auditor, _ = run(flat_tx, sigma=0.0, num_canaries=300, seed=2)
    rep = auditor.report(delta=DELTA, accountant=claimed_acc)
    assert rep.exceeds_accountant, str(rep)


def test_insert_keeps_static_shapes_and_checks_order():
    params = params_like()
    tx = flat_tx(1.0, 0)
    state = tx.init(params)
    auditor = GradientCanaryAuditor(tx, params, num_canaries=40, seed=0, sample_rate=0.1)
    grads = jax.tree_util.tree_map(lambda p: jnp.zeros((5, *p.shape)), params)
    g2, mask = auditor.insert(grads, state)
    assert mask.shape == (5 + auditor.rows_per_step,)
    assert all(x.shape[0] == 5 + auditor.rows_per_step for x in jax.tree_util.tree_leaves(g2))
    with pytest.raises(InvalidGradientError, match="observe"):
        auditor.insert(grads, state)
    out, state = tx.update(g2, state, params, unit_mask=mask)
    auditor.observe(out)
    with pytest.raises(InvalidGradientError, match="insert"):
        auditor.observe(out)
    bad = {"w": jnp.zeros((5, 20, 24)), "b": jnp.zeros((5, 24))}
    with pytest.raises(InvalidGradientError, match="match"):
        auditor.insert(bad, state)
