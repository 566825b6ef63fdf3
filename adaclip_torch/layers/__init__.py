"""Layers that train under per-sample-gradient hooks where torch's own do so poorly."""

from .lstm import DPLSTM, BatchFirstLinear

__all__ = ["DPLSTM", "BatchFirstLinear"]
