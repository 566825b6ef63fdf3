"""Privacy accounting for DP-SGD-style training with adaptive clipping.

What is accounted
-----------------
Every private step of adaclip clips the contribution of each *privacy unit* (an example, or a
user when training is user-level) so that its ℓ2 norm in the clipped (whitened, for AdaCliP)
space is at most 1, sums the clipped contributions of a Poisson-sampled batch and adds
Gaussian noise of standard deviation ``σ`` times that bound. Whatever the clip norm ``C`` and
the AdaCliP scaling are, the release is therefore a *sampled Gaussian mechanism* with
sensitivity 1 and noise multiplier ``σ``: each unit is in the batch independently with
probability ``q`` (the sample rate), and

.. math::

    M(D) = \\sum_{x \\in B} \\bar g(x) + \\mathcal N(0, \\sigma^2 I), \\qquad
    B \\sim \\mathrm{Poisson}(D, q), \\quad \\lVert \\bar g(x) \\rVert_2 \\le 1 .

Adjacency is *add-or-remove-one* (two data sets are neighbours when one is the other plus one
unit), the relation for which Poisson subsampling amplifies privacy. Everything here counts
in units: an (ε, δ) guarantee is per example for example-level training and per user for
user-level training; ``q`` must be the sampling probability *of that unit*.

A training run is a sequence of such steps, possibly with ``(q, σ)`` changing over time
(noise decay, retuning). It is recorded compactly as *runs* ``(q, σ, count)`` and composed
with `dp-accounting <https://github.com/google/differential-privacy>`_ as the event

.. code-block:: python

    ComposedDpEvent([SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), count)
                     for (q, σ, count) in runs])

by either accountant:

- ``"pld"`` (the default): privacy loss distributions (pessimistic discretisation with interval
  ``pld_value_discretization_interval``), composed by FFT: the tightest valid upper bound
  (ε tends to the exact ε of the mechanism as the interval shrinks). A σ calibrated with it is
  about 7 % smaller than RDP's at the same ε (the main job: 0.715 against 0.764).
- ``"rdp"``: Rényi DP of the sampled Gaussian mechanism at a set of orders ``α``, composed
  additively, ``ε_α = Σ_runs count · ε_α(q, σ)``, and converted to (ε, δ)-DP with the
  improved conversion ``ε = min_α ε_α + log((α-1)/α) − (log δ + log α)/(α − 1)``
  (dp-accounting's ``compute_epsilon``). By default dp-accounting's own orders
  (1.1 … 10.9 in steps of 0.1, 11 … 63, 128, 256, 512, 1024). A valid but looser bound,
  kept for runs begun with it (an accountant made with the default resumes a ledger or a
  checkpoint with the mechanism it records) and for comparison.

Reference values (δ = 1e-5), which the defaults reproduce to 1e-3 relative tolerance:
σ = 1.1, q = 256/60000, 14 062 steps → RDP ε ≈ 2.597, PLD ε ≈ 2.382; σ = 1.5, q = 0.04,
2 250 steps → RDP ε ≈ 7.329. The PLD value needs an interval of at most ~5e-4: with 1e-3
the pessimistic estimate is 2.3905 (0.36 % high), hence the default of 1e-4 (2.3817).

``σ = 0`` is accepted and means *no privacy*: any step with ``q > 0`` and ``σ = 0`` makes ε
infinite (and ``delta_for`` 1). Steps with ``q = 0`` touch no data and cost nothing.

dp-accounting's RDP code reports numerical trouble through the ``absl`` logger, e.g.
``_compute_log_a_frac failed to converge ... Excluding this order from the epsilon
computation`` (the order is then dropped, which can only make ε larger, never smaller). A
calibration can trigger thousands of these, so while this package calls into dp-accounting it
raises that logger's level to ``ERROR`` and restores it afterwards. Python warnings
(:func:`warnings.warn`) and exceptions are unaffected.
"""

# How the package is laid out:
# Privacy is described as dp-accounting events (``_events``: one step, one run, a history) and
# composed by one composer per method behind a small protocol (``_composer``): ``_rdp`` for
# ``"rdp"`` and ``_pld`` for ``"pld"``. :class:`Accountant` (``_accountant``) keeps the history,
# the budget search (``_search``) and the versioned saved state (``_persistence``) and asks its
# composer for ε and δ; :func:`calibrate_noise_multiplier` (``_calibration``) asks the same
# composers for dp-accounting accountants. Argument checks (``_checks``, ``_mechanisms``) and the
# silencing of dp-accounting's logs (``_logs``) are shared. Every name is importable from
# ``adaclip.accounting`` itself; the ``_``-prefixed modules are not a public interface.
#
# This module re-exports: every name imported here is for its importers (the names the module
# held before it became a package, private ones included, since tests import some of them).
# ruff: noqa: F401

from __future__ import annotations

from typing import Any

from adaclip.accounting import _events
from adaclip.accounting._accountant import Accountant
from adaclip.accounting._calibration import (
    CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL,
    COARSE_PLD_VALUE_DISCRETIZATION_INTERVAL,
    _calibrate,
    calibrate_noise_multiplier,
)
from adaclip.accounting._checks import (
    _as_float,
    _check_budget,
    _check_count,
    _check_delta,
    _check_discretization,
    _check_epsilon,
    _check_logged,
    _check_noise_multiplier,
    _check_orders,
    _check_sample_rate,
)
from adaclip.accounting._events import Run, _run_event, _step_event
from adaclip.accounting._logs import _ABSL_LOGGER_NAME, _QUIET_LEVEL, _quiet_dp_accounting_logs, _quiet_lock
from adaclip.accounting._mechanisms import (
    DEFAULT_MECHANISM,
    MECHANISM_ALIASES,
    MECHANISMS,
    REFUSED_MECHANISMS,
    _check_mechanism,
    resolve_mechanism,
)
from adaclip.accounting._min_separation import (
    MinSeparationGaussian,
    MinSeparationParticipation,
    block_noise_multipliers,
    calibrate_block_noise_multiplier,
)
from adaclip.accounting._persistence import _STATE_FORMAT, _STATE_VERSION, _prefix_problem
from adaclip.accounting._pld import (
    _PLD_CACHE_SIZE,
    _PLD_HORIZON_FACTOR,
    _PLD_MIN_HORIZON,
    DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL,
    _PldState,
)
from adaclip.accounting._rdp import _RDP_VECTOR_CACHE_SIZE, _default_orders, _rdp_delta, _rdp_epsilon
from adaclip.accounting._search import UNBOUNDED_STEPS, _largest_fitting
from adaclip.accounting.selection import (
    TRIAL_DISTRIBUTIONS,
    Selection,
    calibrate_selection_noise_multiplier,
    draw_number_of_trials,
    probability_never_tried,
    select_privately,
    selection_epsilon,
    selection_event,
)
from adaclip.errors import BudgetExceededError, InvalidHyperparameterError
from adaclip.ledger import PrivacyLedger

__all__ = [
    "Accountant",
    "PrivacyLedger",
    "calibrate_noise_multiplier",
    "MinSeparationGaussian",
    "MinSeparationParticipation",
    "block_noise_multipliers",
    "calibrate_block_noise_multiplier",
    "DEFAULT_MECHANISM",
    "MECHANISMS",
    "MECHANISM_ALIASES",
    "REFUSED_MECHANISMS",
    "resolve_mechanism",
    "DEFAULT_PLD_VALUE_DISCRETIZATION_INTERVAL",
    "CALIBRATION_PLD_VALUE_DISCRETIZATION_INTERVAL",
    "UNBOUNDED_STEPS",
    "TRIAL_DISTRIBUTIONS",
    "Selection",
    "calibrate_selection_noise_multiplier",
    "draw_number_of_trials",
    "probability_never_tried",
    "select_privately",
    "selection_epsilon",
    "selection_event",
]

# _PLD_MIN_HORIZON and _PLD_HORIZON_FACTOR are read back from this module at each search (see
# _pld), so that setting them here still takes effect.


def __getattr__(name: str) -> Any:
    """``_RELATION``, re-exported from ``_events``, which looks it up in dp-accounting on first use:
    importing this package does not load dp-accounting (nor SciPy, which it imports)."""
    if name == "_RELATION":
        return _events._RELATION
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Pickles and reprs name the public objects where they have always been importable.
for _public in (Accountant, calibrate_noise_multiplier, resolve_mechanism):
    _public.__module__ = __name__
del _public
