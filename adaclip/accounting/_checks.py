"""Argument validation shared by the accountant, its persistence and the calibration.

Each check turns a user-supplied value into the number the accounting uses, or raises
:class:`~adaclip.errors.InvalidHyperparameterError` naming the argument; the messages are part
of the behaviour (tests match them). The mechanism names are checked in ``_mechanisms``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping
from typing import Any

from adaclip.errors import InvalidHyperparameterError


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise InvalidHyperparameterError(f"{name} must be a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidHyperparameterError(f"{name} must be a real number, got {value!r}") from None


def _check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    x = _as_float(name, value)
    if not math.isfinite(x) or x < 0:
        raise InvalidHyperparameterError(f"{name} must be finite and >= 0, got {value!r}")
    return x


def _check_sample_rate(value: Any, name: str = "sample_rate", *, allow_zero: bool = True) -> float:
    x = _as_float(name, value)
    low_ok = x >= 0 if allow_zero else x > 0
    if not (low_ok and x <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise InvalidHyperparameterError(f"{name} must be in {interval}, got {value!r}")
    return x


def _check_count(value: Any, name: str = "num_steps") -> int:
    if isinstance(value, bool):
        raise InvalidHyperparameterError(f"{name} must be a positive integer, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidHyperparameterError(f"{name} must be a positive integer, got {value!r}") from None
    if n < 1:
        raise InvalidHyperparameterError(f"{name} must be a positive integer, got {value!r}")
    return int(n)


def _check_epsilon(value: Any, name: str = "target_epsilon") -> float:
    x = _as_float(name, value)
    if not math.isfinite(x) or x <= 0:
        raise InvalidHyperparameterError(f"{name} must be finite and > 0, got {value!r}")
    return x


def _check_delta(value: Any, name: str = "delta") -> float:
    x = _as_float(name, value)
    if not (0 < x < 1):
        raise InvalidHyperparameterError(f"{name} must be in (0, 1), got {value!r}")
    return x


def _check_discretization(value: Any) -> float:
    name = "pld_value_discretization_interval"
    x = _as_float(name, value)
    if not (math.isfinite(x) and 0 < x < 1):
        raise InvalidHyperparameterError(f"{name} must be in (0, 1), got {value!r}")
    return x


def _check_orders(value: Any) -> tuple[float, ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidHyperparameterError(f"rdp_orders must be a sequence of numbers > 1, got {value!r}")
    orders = tuple(_as_float("rdp_orders", a) for a in value)
    if not orders:
        raise InvalidHyperparameterError("rdp_orders must not be empty")
    for a in orders:
        if not (math.isfinite(a) and a > 1):
            raise InvalidHyperparameterError(f"rdp_orders must all be finite and > 1, got {a!r}")
    return orders


def _check_budget(target_epsilon: Any, delta: Any) -> tuple[float | None, float | None]:
    if target_epsilon is None and delta is None:
        return None, None
    if target_epsilon is None:
        raise InvalidHyperparameterError(
            f"delta={delta!r} was given without target_epsilon; give both or neither"
        )
    if delta is None:
        raise InvalidHyperparameterError(
            f"target_epsilon={target_epsilon!r} was given without delta; give both or neither"
        )
    return _check_epsilon(target_epsilon), _check_delta(delta)


def _check_logged(value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidHyperparameterError(f"logged must be True or False, got {value!r}")
    return value
