"""The noise contract: what a noise family is, so that the front ends need nothing else.

A *noise family* turns each step's fresh standard normals ``z_t`` into the noise ``x_t`` the
release adds (scaled by ``σ``), and says how such a run is accounted. Independent noise
(DP-SGD: ``x_t = z_t``) and banded noise are :class:`~adaclip.correlated.BandedNoise`
(``b = 1`` and ``b > 1``); BLT noise is :class:`~adaclip.correlated.BltNoise`. Every family
implements :class:`NoiseFamily`:

- **the stream** — :meth:`~NoiseFamily.init` (a stream that has produced nothing),
  :meth:`~NoiseFamily.correlate` (state and draws in; noise and the next state out; pure, over
  the array API) and :meth:`~NoiseFamily.variance` (``v_t``, the per-coordinate variance of
  ``x_t``, which statistics learned from the release subtract);
- **the sampler it needs** — :attr:`~NoiseFamily.sampler_requirement`, a
  :class:`SamplerRequirement`: the participation pattern the accounting assumes. A front end maps
  it onto its own sampler classes and refuses any other (a shuffling loader is none of them);
- **its accounting** — :meth:`~NoiseFamily.accounting`, a :class:`NoiseAccounting`: at which
  steps the accountant records (the first of each *cycle*), at which rate, and with which noise
  multiplier. Recorded before the cycle's first release, so the accountant is never behind;
- **its checkpoint rule** — :attr:`~NoiseFamily.state_size`, :meth:`~NoiseFamily.saved_buffers`
  and :meth:`~NoiseFamily.checkpoint_tag`: which buffers a stream at a given step holds and what
  a saved stream carries to say which noise made it. The buffers are past noise — as secret as
  the generator's state — and are saved only with it; a stream restored without them restarts:
  empty buffers and a new accounting cycle at the restore (at most one composition more than an
  uninterrupted run).

A front end supplies the random draws (its generator) and the storage (its tensors); the maths,
the sampler it needs and the accounting rule come from the family. A front end may compute
:meth:`~NoiseFamily.correlate` with its own fused kernel for a family it knows (PyTorch does for
banded and BLT noise), held to the family's own method by the tests on the same draws; any other
family runs through the family's method.

**Adding a family** is one file with a class implementing :class:`NoiseFamily` (its maths and its
privacy argument in the docstring) and its tests: the noise against the dense factor, the
accounting against known values, a canary audit. :func:`adaclip.correlated.resolve_noise_mechanism`
passes any object implementing the protocol through; the PyTorch optimizer takes it as
``noise_mechanism=`` with the sampler its :attr:`~NoiseFamily.sampler_requirement` names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

__all__ = [
    "NoiseAccounting",
    "NoiseFamily",
    "NoiseStreamState",
    "SamplerRequirement",
    "is_noise_family",
]

Array = Any

#: The participation patterns a family's accounting can assume: ``"poisson"`` (each unit in
#: each step independently at rate ``q``), ``"cyclic_poisson"`` (units assigned once to one of
#: ``groups`` groups uniformly at random; step ``t`` Poisson-samples group ``t mod groups`` at
#: rate ``groups·q``) and ``"fixed_order"`` (the data cut once into batches visited in the same
#: order every epoch; the separation between a unit's steps is the batches per epoch).
Participation = Literal["poisson", "cyclic_poisson", "fixed_order"]


class NoiseStreamState(NamedTuple):
    """The streaming state of a noise family.

    ``history``: the family's buffers (banded: the last ``b − 1`` noise vectors
    ``x_{t−1}, x_{t−2}, …``, most recent first; BLT: its ``m`` buffers), each a tuple of arrays
    shaped like the parameters — secret, like the generator's state.
    ``step``: how many noise vectors the stream has produced since it (re)started.
    """

    history: tuple[tuple[Array, ...], ...]
    step: int


# Pickles and reprs name the class where it has always been importable.
NoiseStreamState.__module__ = "adaclip.correlated.mechanism"


class SamplerRequirement(NamedTuple):
    """The sampling a family's accounting assumes.

    ``participation``: one of :data:`Participation`. ``groups``: with ``"cyclic_poisson"``, the
    number of groups the sampler cycles over (it must equal the family's; e.g. banded noise's
    ``b``); ``None`` otherwise (with ``"fixed_order"`` the separation is read from the sampler)."""

    participation: Participation
    groups: int | None = None


@runtime_checkable
class NoiseAccounting(Protocol):
    """How a run with this noise is accounted, for one sampler.

    ``rate``: the sample rate each record is made at (``q``; ``b·q`` for banded noise's cyclic
    groups; 1 without amplification). ``cycle``: the accountant records at the first step of each
    cycle of this many steps (counted from the stream's start). :meth:`noise_multiplier` is the
    noise multiplier of the record that opens the cycle starting at ``start``."""

    rate: float
    cycle: int

    def noise_multiplier(self, sigma: float, start: int) -> float: ...


@runtime_checkable
class NoiseFamily(Protocol):
    """The contract every noise family implements (the module docstring says what each part is for).

    ``family``: the family's name (``"banded"``, ``"blt"``, …: what a saved stream and the
    optimizer's report call it). ``size``: its order (banded: ``b``; BLT: ``m``) and
    ``size_label`` what that number counts (``"bands"``, ``"BLT buffers"``). ``state_size``: how
    many buffers a running stream holds at most (banded ``b − 1``, BLT ``m``).
    """

    family: str
    size: int
    size_label: str
    state_size: int
    sampler_requirement: SamplerRequirement

    def init(self) -> NoiseStreamState: ...

    def correlate(self, state: NoiseStreamState, z: Sequence[Array]) -> tuple[list[Array], NoiseStreamState]: ...

    def variance(self, step: int) -> float: ...

    def accounting(self, sample_rate: float, *, separation: int | None = None) -> NoiseAccounting: ...

    def saved_buffers(self, stream_step: int) -> int: ...

    def checkpoint_tag(self) -> dict[str, Any]: ...


def is_noise_family(value: Any) -> bool:
    """Whether ``value`` implements :class:`NoiseFamily` (an object, not a class or a name)."""
    return not isinstance(value, (str, type)) and isinstance(value, NoiseFamily)
