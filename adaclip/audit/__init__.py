"""Empirical privacy: canaries, ε lower bounds, membership inference, the Pareto-tail estimate.

The accountant's ε is an upper bound that holds if the implementation is right; an audit gives
a lower bound measured from the outside, which must stay below it. Framework-agnostic
(NumPy/SciPy); ``adaclip_torch.audit`` and ``adaclip_jax.audit`` insert white-box canaries into
a real training run.

Conventions: a *score* is a float per canary or trial, **higher = more likely included**;
``included`` is the boolean record of which canaries were inserted (independent fair coins for
the one-run bound); ``confidence`` is the probability that a bound holds; ε is stated at
``delta``.

- scores → ε: :func:`one_run_epsilon` (one training run, Steinke, Nasr & Jagielski 2023),
  :func:`threshold_epsilon` (independent trials, Clopper–Pearson), :func:`gdp_fit` (Gaussian-DP
  fit with an interval), :func:`audit_scores` / :class:`AuditReport` (the one-line summary next
  to the accountant's ε); conversions :func:`gdp_epsilon`, :func:`gdp_delta`, :func:`gdp_mu`,
  :func:`clopper_pearson_upper`, :func:`clopper_pearson_interval`, :func:`accountant_epsilon`;
- canaries: :class:`GradientCanaries` (white-box Dirac canaries in the clipping space),
  :func:`mislabelled_canaries`, :func:`out_of_distribution_canaries` (:class:`InputCanaries`,
  black box), :func:`draw_inclusion`, :func:`canary_scores_from_losses`;
- membership inference: :func:`loss_threshold_attack`, :func:`shadow_model_attack`, and the
  metrics :func:`auc`, :func:`auc_interval`, :func:`roc_curve`, :func:`tpr_at_fpr`
  (:class:`MembershipResult`);
- generated text: :func:`pareto_tail_epsilon` (Hill's estimator, :func:`hill_estimator`, checked
  by a Lilliefors test, :func:`lilliefors_exponential`).
"""

from adaclip.audit.estimators import (
    GdpFit,
    OneRunBound,
    ThresholdBound,
    accountant_epsilon,
    clopper_pearson_interval,
    clopper_pearson_upper,
    gdp_delta,
    gdp_epsilon,
    gdp_fit,
    gdp_mu,
    one_run_epsilon,
    threshold_epsilon,
)
from adaclip.audit.gradient_canaries import GradientCanaries
from adaclip.audit.input_canaries import (
    InputCanaries,
    canary_scores_from_losses,
    draw_inclusion,
    mislabelled_canaries,
    out_of_distribution_canaries,
)
from adaclip.audit.membership import (
    MembershipResult,
    auc,
    auc_interval,
    loss_threshold_attack,
    roc_curve,
    shadow_model_attack,
    tpr_at_fpr,
)
from adaclip.audit.pareto import (
    LillieforsResult,
    ParetoTailEstimate,
    hill_estimator,
    lilliefors_exponential,
    pareto_tail_epsilon,
    sequence_log_ratios,
)
from adaclip.audit.report import AuditReport, audit_scores

__all__ = [
    "AuditReport",
    "GdpFit",
    "GradientCanaries",
    "InputCanaries",
    "LillieforsResult",
    "MembershipResult",
    "OneRunBound",
    "ParetoTailEstimate",
    "ThresholdBound",
    "accountant_epsilon",
    "audit_scores",
    "auc",
    "auc_interval",
    "canary_scores_from_losses",
    "clopper_pearson_interval",
    "clopper_pearson_upper",
    "draw_inclusion",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_fit",
    "gdp_mu",
    "hill_estimator",
    "lilliefors_exponential",
    "loss_threshold_attack",
    "mislabelled_canaries",
    "one_run_epsilon",
    "out_of_distribution_canaries",
    "pareto_tail_epsilon",
    "roc_curve",
    "sequence_log_ratios",
    "shadow_model_attack",
    "threshold_epsilon",
    "tpr_at_fpr",
]
