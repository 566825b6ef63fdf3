"""A ``torch.optim.Optimizer`` that is a view of another: the base of
:class:`~adaclip_torch.optimizer.DPOptimizer`.

The wrapper keeps no parameter groups, state or defaults of its own: ``param_groups``,
``state`` and ``defaults`` are the wrapped optimizer's (``original_optimizer``), so LR
schedulers and code that reads or edits them work on the wrapper unchanged.
``add_param_group`` is refused: the private step's transform covers the parameters fixed at
wrapping time (a new group would be stepped on raw gradients), so wrap a new optimizer instead.
"""

from __future__ import annotations

from typing import Any

import torch

from adaclip.errors import InvalidHyperparameterError

__all__ = ["WrappedOptimizer"]


class WrappedOptimizer(torch.optim.Optimizer):
    """Forwards ``param_groups``, ``state`` and ``defaults`` to :attr:`original_optimizer`
    (set by the subclass; deliberately no ``super().__init__``)."""

    original_optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.original_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.original_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.original_optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise InvalidHyperparameterError(
            "add_param_group is not supported on a DPOptimizer: the clipping transform covers the "
            "whole parameter vector; build the wrapped optimizer with every group, then wrap it"
        )
