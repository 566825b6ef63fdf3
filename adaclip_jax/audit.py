"""Auditing a JAX/optax training run with white-box gradient canaries.

::

    tx = adaclip_jax.adaclip(noise_multiplier=σ, expected_batch_size=B, key=key, ...)
    state = tx.init(params)
    auditor = adaclip_jax.audit.GradientCanaryAuditor(tx, params, num_canaries=1000, seed=0, sample_rate=q)
    for batch, mask in batches:                       # padded Poisson batches
        grads = adaclip_jax.per_example_grads(loss_fn)(params, batch)
        grads, mask = auditor.insert(grads, state, unit_mask=mask)
        noisy, state = update(grads, state, params, mask)     # the private transformation (jitted)
        auditor.observe(noisy)
        params = apply_rest_of_the_chain(noisy, ...)           # momentum, Adam, ...
    print(auditor.report(delta=1e-5, accountant=accountant))

The canaries are the Dirac canaries of :class:`adaclip.audit.GradientCanaries`: units of the
training data whose gradient the auditor sets (``a + L·b ⊙ e_j`` from the state's centre and
scale), appended as extra rows of the per-unit gradients and switched on by ``unit_mask``, so
they are clipped and noised by the transformation like every other unit. Each is in the run
with probability ½ and, when in, in each step's batch with the data's Poisson rate ``q``.

:meth:`GradientCanaryAuditor.observe` needs the private transformation's own output (the
noisy gradient), not the update after the rest of an ``optax.chain``: while auditing, apply the
private transformation and the rest of the chain as two steps.

Banded correlated noise (``noise_mechanism="banded"``): the canaries follow the cyclic rule of
the data (each assigned to one of the ``b`` groups, sampled at ``p = b·q`` only in its group's
steps, ``state.step mod b``) and are scored by the matched filter in the whitened domain,
``⟨C r, C s_g⟩`` (:mod:`adaclip.audit.gradient_canaries`); with one band this is the
independent-noise audit bit for bit. The data's own ``unit_mask`` must follow the same rule
(:func:`adaclip_jax.cyclic_poisson_mask`); the auditor cannot check the data's sampling.

Static shapes: :meth:`~GradientCanaryAuditor.insert` always appends ``rows_per_step`` rows
(the sampled canaries, then masked padding), so a jitted update compiles once. A step that
samples more canaries than that inserts only the first ``rows_per_step`` of them (the rest are
simply not in that step: the auditor's choice, independent of the mechanism, so the audit stays
valid and only loses a little power); :attr:`GradientCanaryAuditor.skipped` counts them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from adaclip import strategies as _strategies
from adaclip.audit.gradient_canaries import GradientCanaries, flatten_centre_scale
from adaclip.audit.report import AuditReport
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_jax._state import _find_states
from adaclip_jax._transform import PrivateTransformation

__all__ = ["GradientCanaryAuditor"]


class GradientCanaryAuditor:
    """One-run white-box audit of a private optax transformation (any strategy).

    Args:
      tx: the private transformation (:func:`adaclip_jax.adaclip`, :func:`~adaclip_jax.flat_clip`,
        :func:`~adaclip_jax.private_aggregate`, ...).
      params: the parameters (their tree structure and shapes; values unused).
      num_canaries: ``m ≤ d`` (one coordinate each).
      seed: the auditor's randomness (coordinates, inclusions, sampling).
      sample_rate: ``q``, the data's Poisson rate (the canaries' rate per step).
      canary_norm, inclusion_probability: see :class:`adaclip.audit.GradientCanaries`.
      rows_per_step: canary rows appended to every step (default: the expected number of
        sampled canaries, ``q·m/2``, plus six standard deviations, at least 1).
    """

    def __init__(
        self,
        tx: PrivateTransformation,
        params: Any,
        *,
        num_canaries: int,
        seed: int,
        sample_rate: float,
        canary_norm: float = 10.0,
        inclusion_probability: float = 0.5,
        rows_per_step: int | None = None,
    ) -> None:
        if not isinstance(tx, PrivateTransformation):
            raise InvalidHyperparameterError(f"tx must be an adaclip_jax private transformation, got {tx!r}")
        mechanism = tx.__dict__.get("_adaclip_noise_mechanism")
        coefficients = None if mechanism is None else tuple(float(c) for c in mechanism.coefficients)
        leaves, self._treedef = jax.tree_util.tree_flatten(params)
        self._shapes = [tuple(jnp.shape(p)) for p in leaves]
        self._sizes = [math.prod(s) for s in self._shapes]
        d = sum(self._sizes)
        self.tx = tx
        self.strategy = tx.strategy_for(d)
        self.expected_batch_size = float(tx.expected_batch_size)
        self.canaries = GradientCanaries(
            d,
            num_canaries=num_canaries,
            seed=seed,
            sample_rate=sample_rate,
            canary_norm=canary_norm,
            inclusion_probability=inclusion_probability,
            noise_coefficients=coefficients,
        )
        #: ``b``: the audited transformation's noise bands (1: independent noise)
        self.bands = self.canaries.bands
        if rows_per_step is None:
            # banded: the included canaries of one group (m/b of them) at p = b·q, same mean
            mean = sample_rate * num_canaries * inclusion_probability
            rows_per_step = max(1, min(num_canaries, math.ceil(mean + 6 * math.sqrt(mean) + 1)))
        if isinstance(rows_per_step, bool) or not isinstance(rows_per_step, int) or rows_per_step < 1:
            raise InvalidHyperparameterError(
                f"rows_per_step must be a positive integer, got {rows_per_step!r}"
            )
        self.rows_per_step = rows_per_step
        #: sampled canaries left out of a step because more than rows_per_step were sampled
        self.skipped = 0
        self._pending: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def centre_and_scale(self, opt_state: Any) -> tuple[np.ndarray, np.ndarray]:
        """The flat ``(a, b)`` (float64) the next update clips with, from the private
        transformation's state inside ``opt_state`` (public: a function of earlier releases)."""
        found = _find_states(opt_state)
        if len(found) != 1:
            raise InvalidHyperparameterError(
                f"opt_state holds {len(found)} AdaClipState(s), expected exactly one (the audited transformation's)"
            )
        st = found[0]
        mean = None if st.mean is None else jax.tree_util.tree_leaves(st.mean)
        std = None if st.std is None else jax.tree_util.tree_leaves(st.std)
        core = _strategies.ClipState(step=st.step, mean=mean, std=std, extra=st.extra)
        centre, scale = self.strategy.transform(core, len(self._sizes))
        return flatten_centre_scale(centre, scale, self._sizes)

    def insert(self, per_unit_grads: Any, opt_state: Any, *, unit_mask: Any = None) -> tuple[Any, jax.Array]:
        """Append this step's canary rows to ``per_unit_grads`` (a pytree of ``(n, *shape)``
        arrays) and return ``(grads, unit_mask)`` for the update (``unit_mask``: the given one,
        or all ``True``, then ``True`` for the inserted canaries and ``False`` for padding)."""
        if self._pending is not None:
            raise InvalidGradientError("insert() twice without observe(): observe the previous release first")
        leaves, treedef = jax.tree_util.tree_flatten(per_unit_grads)
        if treedef != self._treedef or [tuple(g.shape[1:]) for g in leaves] != self._shapes:
            raise InvalidGradientError("per_unit_grads do not match the parameters given to the auditor")
        n = int(leaves[0].shape[0])
        if unit_mask is None:
            unit_mask = jnp.ones((n,), bool)
        unit_mask = jnp.asarray(unit_mask, bool)
        if unit_mask.shape != (n,):
            raise InvalidGradientError(f"unit_mask must have shape ({n},), got {unit_mask.shape}")
        a, b = self.centre_and_scale(opt_state)
        step = int(_find_states(opt_state)[0].step)  # the mechanism's step: picks the banded group
        sampled = self.canaries.sample(step)
        self.canaries.check_sampled(sampled, step)  # banded: only group step mod b
        if sampled.size > self.rows_per_step:
            self.skipped += int(sampled.size - self.rows_per_step)
            sampled = sampled[: self.rows_per_step]
        rows = np.zeros((self.rows_per_step, a.size))
        rows[: sampled.size] = self.canaries.gradients(sampled, a, b)
        parts, start = [], 0
        for g, shape, size in zip(leaves, self._shapes, self._sizes, strict=True):
            block = jnp.asarray(rows[:, start : start + size].reshape(self.rows_per_step, *shape), g.dtype)
            parts.append(jnp.concatenate([g, block], axis=0))
            start += size
        mask = jnp.concatenate([unit_mask, jnp.asarray(np.arange(self.rows_per_step) < sampled.size)])
        self._pending = (sampled, a, b, step)
        return jax.tree_util.tree_unflatten(treedef, parts), mask

    def observe(self, released: Any) -> None:
        """Score the release of the step prepared by :meth:`insert`: ``released`` is the private
        transformation's output (the noisy gradient pytree)."""
        if self._pending is None:
            raise InvalidGradientError("observe() without insert(): insert this step's canaries first")
        sampled, a, b, step = self._pending
        flat = np.concatenate(
            [np.asarray(x, dtype=np.float64).reshape(-1) for x in jax.tree_util.tree_leaves(released)]
        )
        # banded: the stream started with the state (zero buffers at step 0 of init), so the
        # whitening filter may use every step the auditor observed
        self.canaries.observe(
            flat, a, b, expected_batch_size=self.expected_batch_size, sampled=sampled,
            step=step, stream_start=0 if self.bands > 1 else None,
        )  # fmt: skip
        self._pending = None

    def report(self, *, delta: float = 1e-5, confidence: float = 0.95, accountant: Any = None) -> AuditReport:
        """``ε_emp`` of the run so far, next to ``accountant.epsilon(delta)`` (an
        :class:`adaclip.accounting.Accountant`, e.g. the one a :class:`~adaclip_jax.PrivacyTracker`
        records into; ``None``: no comparison)."""
        eps = None if accountant is None else float(accountant.epsilon(delta))
        return self.canaries.report(delta=delta, confidence=confidence, accountant_epsilon=eps)
