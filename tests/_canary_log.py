"""Shared by the PyTorch canary-audit tests (banded and BLT noise): log what a
:class:`adaclip.audit.gradient_canaries.GradientCanaries` samples and reads back, and the σ/2
negative control's checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def log_canaries(canaries: Any, *, sampler: Callable[[Any, int | None], Any] | None = None) -> tuple[list, list]:
    """Wrap ``canaries.sample`` and ``canaries.observe`` so that every step's sampled canaries and
    the canaries' read-backs ``(released − a)·B̄/b`` at their coordinates are appended to the
    returned ``(reads, sampled_log)``. ``sampler(canaries, step)`` replaces the sampling (tests
    that force a wrong rule past the refusal)."""
    reads: list = []
    sampled_log: list = []
    sample, observe = canaries.sample, canaries.observe

    def logged_sample(step=None):
        out = sample(step) if sampler is None else sampler(canaries, step)
        sampled_log.append(out)
        return out

    def logged_observe(released, centre, scale, *, expected_batch_size, sampled=None, **kw):
        j = canaries.coordinates
        reads.append((released[j] - centre[j]) * expected_batch_size / scale[j])
        observe(released, centre, scale, expected_batch_size=expected_batch_size, sampled=sampled, **kw)

    canaries.sample, canaries.observe = logged_sample, logged_observe
    return reads, sampled_log


def assert_half_noise_detected(auditor: Any, accountant: Any, correct_run: tuple, *, delta: float) -> None:
    """The σ/2 run (``auditor``, ``accountant``) against the correct run of the same setting
    (``correct_run = (auditor, accountant, ...)``): the accountant saw σ, not σ/2; the GDP fit's
    lower end exceeds the accountant's ε; the one-run bound rises above the correct run's."""
    rep = auditor.report(delta=delta)
    claimed = correct_run[1].epsilon(delta)
    assert accountant.epsilon(delta) == claimed  # the accountant saw σ, not σ/2
    assert rep.gdp.epsilon_lower > claimed, str(rep)
    assert rep.epsilon_lower > correct_run[0].report(delta=delta).epsilon_lower, str(rep)
