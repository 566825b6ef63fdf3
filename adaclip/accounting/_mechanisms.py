"""The names of the accounting methods: the supported ones, their aliases, the refused ones.

:func:`resolve_mechanism` turns the ``accountant=`` keyword (Opacus's; adaclip's old name for it,
``mechanism=``, is deprecated) into one of :data:`MECHANISMS`; each name there has one composer
(``_composer.make_composer``). :func:`accounting_method` is what a public function with both
keywords calls: it warns about the old one.
"""

from __future__ import annotations

from typing import Any

from adaclip.errors import InvalidHyperparameterError
from adaclip.options import warn_mechanism_keyword

#: The accounting methods :class:`Accountant` supports.
MECHANISMS: tuple[str, ...] = ("rdp", "pld")

#: The method used when none is named: privacy loss distributions, the tightest valid upper
#: bound (RDP's bound is looser: a σ calibrated with it is about 7 % larger at the same ε).
DEFAULT_MECHANISM: str = "pld"

#: Other names accepted for a mechanism, and the mechanism they stand for. ``"prv"`` is Opacus's
#: default accountant (Gopi et al., 2021: the privacy loss *random variable*, whose distribution
#: is the privacy loss distribution): it and ``"pld"`` compute the same quantity, the
#: distribution of the privacy loss of the Poisson-subsampled Gaussian, numerically (a
#: discretisation composed by FFT), and both report an upper bound on ε. ``"prv"`` is computed
#: with dp-accounting's PLD (pessimistic discretisation) — see the Accounting page, "Opacus's
#: accountants", for the comparison with Opacus's own PRV accountant.
MECHANISM_ALIASES: dict[str, str] = {"prv": "pld"}

#: Names that are refused, with the reason (they would not give an upper bound on ε).
REFUSED_MECHANISMS: dict[str, str] = {
    "gdp": (
        "Opacus's 'gdp' accountant applies the central limit theorem to the composed subsampled "
        "Gaussian steps (mu-GDP); that is an approximation, not an upper bound on epsilon, and it "
        "under-reports epsilon in ordinary settings (sigma=1.0, q=0.01, 1000 steps, delta=1e-5: "
        "GDP says 1.62, the PLD upper bound is 1.83). Use 'pld' (a tight upper bound; 'prv', "
        "Opacus's default, is computed as 'pld') or 'rdp' (a looser upper bound, faster)"
    ),
}


def _check_mechanism(value: Any, name: str = "mechanism") -> str:
    """The mechanism ``value`` names (``"prv"`` → ``"pld"``); refused names say why."""
    if isinstance(value, str):
        if value in REFUSED_MECHANISMS:
            raise InvalidHyperparameterError(f"{name}={value!r} is refused: {REFUSED_MECHANISMS[value]}")
        value = MECHANISM_ALIASES.get(value, value)
        if value in MECHANISMS:
            return value
    accepted = (*MECHANISMS, *MECHANISM_ALIASES)
    raise InvalidHyperparameterError(
        f"{name} must be one of {accepted} ('prv' is computed as 'pld'), got {value!r}"
    )


def resolve_mechanism(mechanism: Any = None, accountant: Any = None, *, default: str = DEFAULT_MECHANISM) -> str:
    """The accounting mechanism named by ``mechanism=`` (adaclip's keyword) or ``accountant=``
    (Opacus's, a string), as one of :data:`MECHANISMS`.

    ``None`` for both: ``default`` (:data:`DEFAULT_MECHANISM`, ``"pld"``). ``accountant`` (when
    not ``None``) wins over a ``mechanism`` not given (``None``, or — as callers from before
    ``None`` meant "not given" pass it — equal to ``default``); the two given with different
    meanings are refused. ``"prv"`` means ``"pld"`` (:data:`MECHANISM_ALIASES`); ``"gdp"`` is
    refused with the reason (:data:`REFUSED_MECHANISMS`).

    Raises:
        InvalidHyperparameterError: an unknown or refused name, a non-string ``accountant``, or
            the two keywords naming different mechanisms.
    """
    chosen = _check_mechanism(default if mechanism is None else mechanism)
    if accountant is None:
        return chosen
    if not isinstance(accountant, str):
        raise InvalidHyperparameterError(
            f"accountant= takes the name of the accounting method ('rdp', 'pld' or 'prv', as in Opacus's "
            f"PrivacyEngine(accountant=...)), got {type(accountant).__name__}; to use an Accountant object "
            "of your own, pass it to the optimizer wrapper (accountant=, sample_rate=)"
        )
    other = _check_mechanism(accountant, "accountant")
    if mechanism is not None and chosen != other:
        raise InvalidHyperparameterError(
            f"{mechanism!r} (mechanism=, accountant='s old name, or a positional argument) and "
            f"accountant={accountant!r} name different accounting methods; give one of them"
        )
    return other


def accounting_method(accountant: Any, mechanism: Any, *, caller: str, stacklevel: int = 3) -> str:
    """The accounting method a public function was given: ``accountant=`` (the keyword), or its
    deprecated old name ``mechanism=``, which warns :class:`FutureWarning` at the user's line
    (``stacklevel`` counts from this function: 3 when ``caller`` calls it from its own body).
    Neither given: :data:`DEFAULT_MECHANISM`. Both given must agree (:func:`resolve_mechanism`).
    """
    if mechanism is not None:
        warn_mechanism_keyword(caller, stacklevel=stacklevel)
    return resolve_mechanism(mechanism, accountant)
