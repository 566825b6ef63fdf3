"""The streaming state shared by every correlated-noise mechanism.

:class:`NoiseStreamState` lives here, apart from :mod:`adaclip.correlated.mechanism` (which
re-exports it, its public home) and :mod:`adaclip.correlated.blt`, so that both can import it
and ``mechanism`` can import ``blt`` at the top without an import cycle.
"""

from __future__ import annotations

from typing import Any, NamedTuple

Array = Any


class NoiseStreamState(NamedTuple):
    """The streaming state of a noise mechanism.

    ``history``: the last ``b − 1`` noise vectors ``x_{t−1}, x_{t−2}, …`` (most recent first),
    each a list of arrays shaped like the parameters — secret, like the generator's state.
    ``step``: how many noise vectors the stream has produced since it (re)started.
    """

    history: tuple[tuple[Array, ...], ...]
    step: int


# Pickles and reprs name the class where it has always been importable.
NoiseStreamState.__module__ = "adaclip.correlated.mechanism"
