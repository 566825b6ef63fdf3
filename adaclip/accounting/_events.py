"""The privacy events of a training run, as dp-accounting describes them.

One private step is the Poisson-subsampled Gaussian mechanism with sample rate ``q`` and noise
multiplier ``σ`` (sensitivity 1); ``count`` equal steps in a row form a *run* ``(q, σ, count)``,
the unit in which :class:`~adaclip.accounting.Accountant` keeps its history and the composers
compose. A history is the composition of its runs, in order:

.. code-block:: python

    ComposedDpEvent([SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), count)
                     for (q, σ, count) in runs])

Neighbouring data sets differ by adding or removing one unit (:data:`_RELATION`), the relation
under which Poisson subsampling amplifies privacy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import dp_accounting

#: One run of equal steps: ``(sample_rate, noise_multiplier, count)``.
Run = tuple[float, float, int]


def __getattr__(name: str) -> Any:
    """``_RELATION`` (dp-accounting's ``NeighboringRelation.ADD_OR_REMOVE_ONE``), looked up on
    first use so that importing :mod:`adaclip.accounting` does not load dp-accounting."""
    if name == "_RELATION":
        # lazy: dp-accounting loads SciPy and absl (1-2 s); only accounting itself needs the enum
        from dp_accounting.privacy_accountant import NeighboringRelation

        return NeighboringRelation.ADD_OR_REMOVE_ONE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _step_event(q: float, sigma: float) -> dp_accounting.DpEvent:
    """One step: the Gaussian mechanism (noise multiplier σ) on a Poisson sample at rate q."""
    import dp_accounting  # lazy: dp-accounting loads SciPy and absl (1-2 s); only accounting needs it

    return dp_accounting.PoissonSampledDpEvent(
        sampling_probability=q, event=dp_accounting.GaussianDpEvent(noise_multiplier=sigma)
    )


def _run_event(q: float, sigma: float, count: int) -> dp_accounting.DpEvent:
    """``count`` equal steps."""
    import dp_accounting  # lazy: dp-accounting loads SciPy and absl (1-2 s); only accounting needs it

    return dp_accounting.SelfComposedDpEvent(event=_step_event(q, sigma), count=count)


def history_event(runs: Sequence[Run]) -> dp_accounting.DpEvent:
    """The runs composed in order (``NoOpDpEvent`` when there are none)."""
    import dp_accounting  # lazy: dp-accounting loads SciPy and absl (1-2 s); only accounting needs it

    if not runs:
        return dp_accounting.NoOpDpEvent()
    return dp_accounting.ComposedDpEvent([_run_event(q, s, c) for q, s, c in runs])
