"""Auditing a PyTorch training run: white-box gradient canaries and per-example losses.

::

    opt = adaclip_torch.AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, ...,
                                accountant=Accountant(), sample_rate=q)
    auditor = adaclip_torch.audit.GradientCanaryAuditor(opt, num_canaries=1000, seed=0)
    for x, y in loader:
        loss_fn(model(x), y).backward()
        auditor.step()          # in place of opt.step(): inserts canaries, steps, reads the release
        opt.zero_grad()
    print(auditor.report(delta=1e-5))   # ε_emp with its confidence, next to the accountant's ε

The canaries are the Dirac canaries of :class:`adaclip.audit.GradientCanaries`: units of the
training data whose gradient the auditor sets, added through
:meth:`adaclip_torch.DPOptimizer.add_unit_gradients` (so they are clipped and noised by the
mechanism, never past it), each in the run with probability ½ and, when in, in each step's
batch with the data's Poisson rate. The auditor reads each canary's coordinate of the released
gradient (captured as the wrapped optimizer receives it, before momentum or Adam) and scores
it. For black-box audits (mislabelled or out-of-distribution examples in the data) use
:mod:`adaclip.audit.input_canaries` and :func:`per_example_losses`.

Banded correlated noise (``optimizer.noise_mechanism == "banded"``): the canaries follow the
optimizer's cyclic Poisson rule (each in one of ``b`` groups, drawn independently and uniformly;
at optimizer step ``t`` only group ``t mod b`` is sampled, at rate ``b·q``), so none joins two
steps less than ``b`` apart and the audit measures the mechanism as it is accounted; and each
canary is scored by the matched filter in the whitened domain, ``⟨C r, C s_g⟩`` (``C`` the
noise's banded Toeplitz matrix, ``r`` the canary's read-back series, ``s_g`` its group's steps),
the likelihood-ratio direction for ``y = G + σ C⁻¹ z``. Why, and why the score may use the
group but not the actual participations: :mod:`adaclip.audit.gradient_canaries`. With one band
this is the independent-noise audit, bit for bit.

BLT noise (``optimizer.noise_mechanism == "blt"``, fixed-order batches, no amplification): the
canaries follow the fixed order — each in one of the optimizer's ``b = optimizer.min_separation``
slots, drawn independently and uniformly, and an included one in *every* step ``t ≡ slot (mod
b)``, the participation the BLT accounting covers — and each is scored by the normalised
matched filter in the whitened domain, ``⟨C r, C s_g⟩/‖C s_g‖`` with ``C`` the BLT's dense
Toeplitz matrix (:meth:`adaclip.correlated.BltNoise.whiten`): ``N(0, σ²)`` without the canary
and shifted by ``‖C s_g‖`` with it, so a correct run shows GDP ``μ ≈ ‖C s_g‖/σ``, at most (slot 0:
exactly) the accountant's ``Δ_T/σ``. A ``sample_rate`` is refused (there is no sampling to
match), and so is a step after a release the auditor did not see (the whitening needs them all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from adaclip.audit.gradient_canaries import GradientCanaries, flatten_centre_scale
from adaclip.audit.report import AuditReport
from adaclip.errors import InvalidHyperparameterError
from adaclip_torch.optimizer import DPOptimizer

__all__ = ["GradientCanaryAuditor", "per_example_losses"]


class GradientCanaryAuditor:
    """One-run white-box audit of a :class:`~adaclip_torch.DPOptimizer` (any strategy, any
    per-sample mode).

    Call :meth:`step` instead of ``optimizer.step()`` (same arguments). Each call samples the
    included canaries for this step, adds their gradients ``a + L·b ⊙ e_j`` (from the
    optimizer's :meth:`~adaclip_torch.DPOptimizer.centre_and_scale`) as extra units, steps, and
    adds ``(g̃_j − a_j)·B̄/b_j`` to each canary's score (banded and BLT noise: whitened by ``C``
    and matched to the canary's group or slot, see the module docstring). :meth:`report` turns the scores
    into ``ε_emp`` next to the optimizer's accountant.

    What makes ``ε_emp`` a valid lower bound on the ε the accountant reports: each canary's
    inclusion is an independent coin with probability ½ that the training never sees, and the
    mechanism is DP with respect to each canary *as accounted* — the canaries are units sampled
    like the data (Poisson at ``q``; with banded noise cyclic Poisson with the optimizer's
    ``b``, at rate ``b·q`` in their group's steps; with BLT noise the fixed order, every step
    of their slot) and clipped and noised by the optimizer — while the score uses only the
    releases and public information (coordinates, the ``(a, b)`` of each step, the canaries'
    groups or slots), never the coins nor the sampling draws.

    Args:
      optimizer: the private optimizer (its ``sample_rate`` is the canaries' rate unless
        ``sample_rate`` is given).
      num_canaries: ``m ≤ d`` (one coordinate each). A few hundred to a few thousand; the
        one-run bound can certify at most about ``log`` of the odds of a correct guess among
        the ``k`` most confident, so small ``m`` caps ``ε_emp`` well below large ε.
      seed: the auditor's randomness (coordinates, inclusions, sampling).
      sample_rate: ``q`` for the canaries (default: the optimizer's; required if it has none).
        With banded noise the canaries are sampled at ``b·q`` in their group's steps
        (``b·q ≤ 1``). With BLT noise leave it out (refused: the canaries follow the fixed
        order's slots, ``b`` read from the optimizer's ``min_separation``).
      canary_norm, inclusion_probability: see :class:`adaclip.audit.GradientCanaries`.

    Memory: the canaries sampled in one step are materialised as dense per-unit gradients,
    ``(#sampled, d)`` in the statistics dtype (about ``q·m/2`` rows).
    """

    def __init__(
        self,
        optimizer: DPOptimizer,
        *,
        num_canaries: int,
        seed: int,
        sample_rate: float | None = None,
        canary_norm: float = 10.0,
        inclusion_probability: float = 0.5,
    ) -> None:
        if not isinstance(optimizer, DPOptimizer):
            raise InvalidHyperparameterError(
                f"optimizer must be an adaclip_torch.DPOptimizer, got {optimizer!r}"
            )
        q = optimizer.sample_rate if sample_rate is None else sample_rate
        if q is None and optimizer.noise_mechanism != "blt":
            raise InvalidHyperparameterError(
                "the optimizer has no sample_rate: pass sample_rate= (the data's Poisson rate q) to the auditor"
            )
        self.optimizer = optimizer
        self._sizes = [p.numel() for p in optimizer.params]
        self._correlated = optimizer.noise_mechanism != "independent"
        rule: dict[str, Any]
        if optimizer.noise_mechanism == "blt":
            if sample_rate is not None:
                raise InvalidHyperparameterError(
                    f"sample_rate={sample_rate!r} with BLT noise: the optimizer is accounted for fixed-order "
                    "batches without amplification, so the canaries follow the fixed order (each in one slot of "
                    "the optimizer's min_separation b, an included one in every step of its slot) and have no "
                    "sampling rate; leave sample_rate out"
                )
            rule = {"blt": optimizer.correlated_noise, "min_separation": optimizer.min_separation}
        else:
            banded = optimizer.noise_mechanism == "banded"
            rule = {"sample_rate": q, "noise_coefficients": _noise_coefficients(optimizer) if banded else None}
        self.canaries = GradientCanaries(
            sum(self._sizes),
            num_canaries=num_canaries,
            seed=seed,
            canary_norm=canary_norm,
            inclusion_probability=inclusion_probability,
            **rule,
        )
        self._captured: np.ndarray | None = None
        self._hook = optimizer.original_optimizer.register_step_pre_hook(self._capture)

    def _capture(self, *_: Any) -> None:
        """Read the release as the wrapped optimizer receives it (its ``p.grad``)."""
        self._captured = np.concatenate(
            [p.grad.detach().to("cpu", torch.float64).reshape(-1).numpy() for p in self.optimizer.params]
        )

    def step(self, closure: Callable[[], Any] | None = None, **step_kwargs: Any) -> Any:
        """Insert this step's canaries, call ``optimizer.step(closure, **step_kwargs)``, score."""
        opt = self.optimizer
        centre, scale = opt.centre_and_scale()
        a, b = flatten_centre_scale(centre, scale, self._sizes)
        t = opt.steps
        stream_start = _stream_start(opt) if self._correlated else None
        if self._correlated:
            self.canaries.check_step(t, stream_start)  # BLT: no release missed since the last step
        sampled = self.canaries.sample(t)
        self.canaries.check_sampled(sampled, t)  # distinct; banded/BLT: only group/slot t mod b
        if sampled.size:
            rows = self.canaries.gradients(sampled, a, b)
            grads, start = [], 0
            for p, size in zip(opt.params, self._sizes, strict=True):
                part = rows[:, start : start + size].reshape(len(sampled), *p.shape)
                grads.append(torch.as_tensor(part, dtype=torch.float64, device=p.device))
                start += size
            opt.add_unit_gradients(grads)
        self._captured = None
        loss = opt.step(closure, **step_kwargs)
        if self._captured is None:
            raise RuntimeError("the wrapped optimizer did not step: nothing was released to audit")
        self.canaries.observe(
            self._captured, a, b, expected_batch_size=opt.expected_batch_size, sampled=sampled,
            step=t, stream_start=stream_start,
        )  # fmt: skip
        return loss

    def report(self, *, delta: float = 1e-5, confidence: float = 0.95) -> AuditReport:
        """``ε_emp`` of the run so far, next to the optimizer's accountant's ε at ``delta``
        (``None`` without an accountant)."""
        acc = self.optimizer.accountant
        eps = None if acc is None else float(acc.epsilon(delta))
        return self.canaries.report(delta=delta, confidence=confidence, accountant_epsilon=eps)

    def remove(self) -> None:
        """Detach the capture hook from the wrapped optimizer."""
        self._hook.remove()


def _noise_coefficients(optimizer: DPOptimizer) -> tuple[float, ...]:
    """The banded noise's ``c_0 … c_{b−1}``."""
    coefficients = optimizer.noise_coefficients
    assert coefficients is not None
    return coefficients


def _stream_start(optimizer: DPOptimizer) -> int:
    """The optimizer step at which its noise stream (re)started: the whitening restarts there."""
    start = optimizer.noise_stream_start
    assert start is not None
    return start


@torch.no_grad()
def per_example_losses(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
    batch_size: int = 1024,
) -> np.ndarray:
    """Per-example losses of ``model`` on ``(x, y)`` (``loss_fn(outputs, targets)`` with
    ``reduction="none"``; default cross-entropy), in eval mode, as float64 NumPy.

    The scores of input canaries and of the loss-threshold attack are ``−loss``
    (:func:`adaclip.audit.canary_scores_from_losses`).
    """
    if loss_fn is None:
        loss_fn = nn.CrossEntropyLoss(reduction="none")
    if len(x) != len(y):
        raise ValueError(f"x and y have different lengths: {len(x)} and {len(y)}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    was_training = model.training
    model.eval()
    try:
        out = [loss_fn(model(x[i : i + batch_size]), y[i : i + batch_size]).reshape(-1)
               for i in range(0, len(x), batch_size)]  # fmt: skip
    finally:
        model.train(was_training)
    losses = torch.cat(out).to(torch.float64).cpu().numpy() if out else np.zeros(0)
    if losses.shape != (len(x),):
        raise ValueError(f"loss_fn must return one loss per example (reduction='none'), got {losses.shape}")
    return losses
