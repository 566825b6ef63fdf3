"""Say so when a restored accountant changes mechanism under the user.

An accountant built with the default mechanism (PLD) goes on with the mechanism of the run it
resumes (its ledger's or its checkpoint's): a run begun with RDP stays accounted with RDP, so
its ε is never computed two ways. But a σ calibrated with PLD for the resumed run is about 7 %
smaller than the RDP plan's, so the budget would run out before the planned steps; every front
end (PyTorch checkpoints, the JAX tracker) warns with this one function.
"""

from __future__ import annotations

import warnings

__all__ = ["warn_if_mechanism_adopted"]


def warn_if_mechanism_adopted(before: object, after: object, *, stacklevel: int = 3) -> None:
    """A ``UserWarning`` when a restore turned a PLD accountant (the default) into an RDP one."""
    if before == "pld" and after == "rdp":
        warnings.warn(
            "this checkpoint's run is accounted with RDP (it records mechanism='rdp'), so the accountant goes "
            "on with RDP (it was made with "
            "the default, PLD). A noise multiplier calibrated for this run with PLD (make_private, "
            "calibrate_noise_multiplier, plan_banded_noise) is about 7% below what the run's RDP plan used, so "
            "the budget may run out before the planned steps (the accountant refuses the step that would "
            "exceed it). Build the accountant with accountant='rdp' (make_private(..., accountant='rdp'), "
            "Accountant(accountant='rdp')) to resume with the run's own noise multiplier",
            UserWarning,
            stacklevel=stacklevel,
        )
