"""The ghost-norm contract of one layer type: :class:`GhostLayer`.

A layer type takes the ghost path (norms and clipped sums from what the hooks captured, no stored
per-example gradients; :mod:`adaclip_torch.ghost` has the maths) when its per-sample rule is
registered together with a subclass of :class:`GhostLayer`::

    @register_grad_sampler(nn.Linear, ghost=LinearGhost)
    def linear_grad_sample(module, activations, backprops): ...

so a layer type's per-sample rule, ghost norm and weighted sum live in one file
(:mod:`.linear`, :mod:`.conv`, :mod:`.embedding`, :mod:`.hf`). A subclass names its ``kind``,
says which modules of the registered types it serves (:meth:`GhostLayer.applies`), and
implements four things on the captured ``(input, output gradient)`` pairs of one batch:

* ``_capture(captures)``: keep the tensors it needs, in the statistics dtype;
* ``_terms(name, d, centre, scale, scalar)``: an estimate of the squared transformed norms
  ``‖(g_i − a)/b‖²`` (``D = 1/b²``) and a bound on its rounding error;
* ``_exact_rows(name, centre, scale, rows)``: direct upper bounds for the units ``rows`` (no
  cancellation: used where the estimate's error bound is loose);
* ``_weighted_sum(name, cs, keep, dropped)`` and ``_materialise(name, rows)``: ``Σ_i c_i g_i``
  (from the captured tensors, with ``cs`` the clip factors with the loss scale folded in,
  :meth:`GhostLayer._fold_scale`; ``keep`` the units with ``c_i > 0``) and the per-example
  gradients.

A parameter named in ``small_names`` (a bias) is served by ``_small_samples(name)``, its
``(n, ...)`` per-example gradients, which this class forms once per batch, norms directly, sums
and materialises.

This base class adds what every layer type shares and what privacy rests on: the returned norm
is the estimate *plus* its error bound (rounding can only over-clip), units whose bound is loose
are recomputed exactly, and every product runs in full float32 precision
(:class:`~adaclip_torch._precision.full_float32_precision`). A subclass's ``_terms`` must
therefore return an error bound that holds for IEEE float products of its own reductions
(:func:`margin` gives the blocked-summation bound of a reduction of a given length).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from adaclip import transform as _transform
from adaclip_torch._precision import full_float32_precision

__all__ = ["GhostLayer", "GhostSource", "build_layers", "OVERCLIP_TOLERANCE", "CHUNK_ELEMENTS", "margin", "is_scalar", "square_sum"]

Tensor = torch.Tensor

#: Largest relative over-clip the ghost bound may cause before a unit's norm is recomputed
#: exactly (see :meth:`GhostLayer.norm`).
OVERCLIP_TOLERANCE = 1e-2

#: Elements of one transient chunk of per-example gradients (exact norms of a few units).
CHUNK_ELEMENTS = 1 << 22

#: ``kind`` -> the :class:`GhostLayer` subclass serving it (filled by ``__init_subclass__``).
GHOST_KINDS: dict[str, type[GhostLayer]] = {}


def square_sum(t: Tensor) -> Tensor:
    """``Σ t²`` as one dot product (no temporary of ``t``'s size when ``t`` is contiguous)."""
    flat = t.reshape(-1)
    return torch.dot(flat, flat)


def is_scalar(scale: Any) -> bool:
    """Whether a scale ``b`` is one number for the whole tensor: a Python float (flat
    clipping's ``C``) or a 0-d tensor (a clip norm kept in the state, the quantile rule's ``C_t``)."""
    return not isinstance(scale, Tensor) or scale.ndim == 0


#: ``margin(dtype, *lengths)``: the rounding margin of a nested reduction, the sum of each
#: level's blocked-summation bound (:func:`adaclip.transform.nested_rounding_margin`).
margin = _transform.nested_rounding_margin


def direct_norms(g: Tensor, centre: Tensor | None, scale: Any) -> Tensor:
    """The core's bound on materialised gradients ``g`` (no expansion, no cancellation)."""
    return _transform.transformed_sq_norms([g], None if centre is None else [centre], [scale])[0]


def _split_loss_scale(captures: list[tuple[Any, ...]]) -> tuple[list[tuple[Tensor, Tensor]], float]:
    """``(pairs, s)`` from the captured ``(input, output gradient[, s])`` calls: example i's output
    gradient is ``s·`` the captured one (``s = n`` under ``loss_reduction="mean"``, 1 if absent).
    Calls with different ``s`` (never from one batch's hooks) are scaled here, and ``s = 1``."""
    scales = [float(c[2]) if len(c) > 2 else 1.0 for c in captures]
    if len(set(scales)) == 1:
        return [(c[0], c[1]) for c in captures], scales[0]
    return [(c[0], c[1] * s if s != 1.0 else c[1]) for c, s in zip(captures, scales, strict=True)], 1.0


class GhostSource:
    """What the engine asks of a ghost source (a :class:`GhostLayer`, or
    :class:`~adaclip_torch.ghost.TiedGhost` for a tied weight): per parameter ``name``, an upper
    bound of the squared transformed norms (:meth:`norm_within_guard`) and the weighted sum
    (:meth:`weighted_sum_within_guard`), both for a caller that holds
    :class:`~adaclip_torch._precision.full_float32_precision`. The engine asks once per source
    for all of its parameters (:meth:`norms_within_guard`, :meth:`weighted_sums_within_guard`):
    the answers are the per-parameter ones, in order."""

    def norm_within_guard(self, name: str, centre: Tensor | None, scale: Any) -> Tensor:
        raise NotImplementedError

    def weighted_sum_within_guard(self, name: str, c: Tensor) -> Tensor:
        raise NotImplementedError

    def norms_within_guard(self, names: Sequence[str], centres: Sequence[Tensor | None], scales: Sequence[Any]) -> list[Tensor]:
        """:meth:`norm_within_guard` of each of ``names``, in order."""
        return [self.norm_within_guard(n, a, b) for n, a, b in zip(names, centres, scales, strict=True)]

    def weighted_sums_within_guard(self, names: Sequence[str], factors: Sequence[Tensor]) -> list[Tensor]:
        """:meth:`weighted_sum_within_guard` of each of ``names`` with its clip factors, in order."""
        return [self.weighted_sum_within_guard(n, c) for n, c in zip(names, factors, strict=True)]


class GhostLayer(GhostSource):
    """The captured calls of one ghost module in one (accumulated) batch.

    ``GhostLayer(module, kind, captures, dtype, mode)`` builds the subclass registered for
    ``kind`` from the captured ``(input, output gradient, s)`` calls (``s·`` the output gradient
    is the per-example one; ``(input, output gradient)`` means ``s = 1``) (``"linear"``, ``"linear_t"``, ``"conv"``, ``"embedding"``, or a user's).
    ``norm(name, centre, scale)`` gives an *upper bound* of the ``(n,)`` squared transformed
    norms of parameter ``name``; ``weighted_sum(name, c)`` gives ``Σ_i c_i g_i`` (units with
    ``c_i = 0`` contribute exactly 0, whatever their entries); ``materialise(name)`` the
    ``(n, *shape)`` per-example gradients (used only where the ghost path does not apply,
    e.g. grouping by user).

    Inputs and output gradients with NaN/inf entries are kept as they are: such a unit's norm
    comes out non-finite, the core gives it the clip factor 0 and :meth:`weighted_sum` drops it.
    """

    #: The name engines and :class:`~adaclip_torch.ghost.TiedGhost` know this layer type by.
    kind: ClassVar[str] = ""
    #: Only in ``per_sample_mode="ghost"`` (the memory mode), not ``"auto"``: for layer types whose
    #: ghost form is usually dearer than forming the per-example gradients (convolutions).
    memory_mode_only: ClassVar[bool] = False
    #: The parameters whose per-example gradients are small enough to form (a bias, ``(n, out)``):
    #: :meth:`_small_samples` gives them once per batch, and this class norms them directly,
    #: sums and materialises them; the ghost forms serve the others.
    small_names: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kind:
            GHOST_KINDS[cls.kind] = cls

    def __new__(cls, module: nn.Module, kind: str, *args: Any, **kwargs: Any) -> GhostLayer:
        if cls is GhostLayer:
            try:
                cls = GHOST_KINDS[kind]
            except KeyError:
                raise ValueError(f"no ghost layer is registered for kind {kind!r}; known: {sorted(GHOST_KINDS)}") from None
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Module,
        kind: str,
        captures: list[tuple[Tensor, Tensor]],
        dtype: torch.dtype,
        mode: str,
        *,
        unit_roundoff: float | None = None,
    ):
        if kind != type(self).kind:
            raise ValueError(f"{type(self).__name__} serves kind {type(self).kind!r}, not {kind!r}")
        self.module = module
        self.mode = mode
        self.dtype = dtype
        #: ``u`` of ``dtype`` (:func:`adaclip.transform.unit_roundoff`), for the error bounds.
        self.unit_roundoff = _transform.unit_roundoff(dtype) if unit_roundoff is None else unit_roundoff
        self._small: dict[str, Tensor] = {}
        self.n = int(captures[0][1].shape[0])
        pairs, self.loss_scale = _split_loss_scale(captures)
        self._capture(pairs)

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        """Whether ``module`` (of a type this class is registered for) can take this ghost form."""
        return True

    # ------------------------------------------------------------------ the contract
    def norm(self, name: str, centre: Tensor | None, scale: Any) -> Tensor:
        """:meth:`norm_within_guard` under :class:`~adaclip_torch._precision.full_float32_precision`."""
        with full_float32_precision():
            return self.norm_within_guard(name, centre, scale)

    def weighted_sum(self, name: str, c: Tensor) -> Tensor:
        """:meth:`weighted_sum_within_guard` under :class:`~adaclip_torch._precision.full_float32_precision`."""
        with full_float32_precision():
            return self.weighted_sum_within_guard(name, c)

    def norm_within_guard(self, name: str, centre: Tensor | None, scale: Any) -> Tensor:
        """An upper bound of ``‖(g_i − centre)/scale‖²``, shape ``(n,)``, for a caller that holds
        :class:`~adaclip_torch._precision.full_float32_precision` (the engine's clipped sum does,
        once per step; :meth:`norm` takes it itself).

        With a centre the ghost forms expand the norm as ``A − 2B + C`` (``A = Σ D g²``,
        ``B = Σ (D a) g``, ``C = Σ D a²``, ``D = 1/b²``), which cancels when ``‖a/b‖`` is much
        larger than ``‖(g − a)/b‖``: in float32 a unit of transformed norm 3 can come out below
        1 at ``‖a/b‖ = 10⁴``. So each term's rounding error is bounded by a magnitude ``M_i``
        (``|B| ≤ √(A·C)`` by Cauchy–Schwarz, Gram forms by ``(Σ_t ‖x_t‖‖e_t‖)²``) times the
        margin of its reductions (:func:`adaclip.transform.rounding_margin`), and the bound
        ``A − 2B + C + η·M_i`` is returned: rounding can only over-clip. Where that bound is
        loose (its error term above :data:`OVERCLIP_TOLERANCE` of it), the unit's norm is
        recomputed directly from its materialised gradient, which does not cancel.
        """
        if name in self.small_names:
            return direct_norms(self._small_of(name), centre, scale)
        centre, scale = self._as_matrix(centre), self._as_matrix(scale)
        scalar = is_scalar(scale)
        d = 1.0 / (scale * scale)
        estimate, error = self._terms(name, d, centre, scale, scalar)
        bound = (estimate + error).clamp_min(0.0)
        loose = error > OVERCLIP_TOLERANCE * bound  # False for NaN: a non-finite unit stays so
        if bool(loose.any()):
            rows = torch.nonzero(loose).reshape(-1)
            bound = bound.index_copy(0, rows, self._exact(name, centre, scale, rows))
        return bound

    def weighted_sum_within_guard(self, name: str, c: Tensor) -> Tensor:
        """``Σ_i c_i g_i`` shaped like the parameter; units with ``c_i = 0`` are dropped. For a
        caller that holds :class:`~adaclip_torch._precision.full_float32_precision`."""
        c = c.to(self.dtype)
        keep = c > 0
        dropped = not bool(keep.all())
        if name in self.small_names:  # Σ_i c_i g_i over the formed (n, ...) gradients, dropped rows 0
            g = self._small_of(name)
            flat = g.reshape(g.shape[0], math.prod(g.shape[1:]))  # (n, m), also for n = 0
            return (c @ (torch.where(keep[:, None], flat, 0.0) if dropped else flat)).reshape(g.shape[1:])
        return self._weighted_sum(name, self._fold_scale(c), keep, dropped)

    def materialise(self, name: str, rows: Tensor | None = None) -> Tensor:
        """Per-example gradients of ``name`` (of the units ``rows`` only, if given)."""
        if name in self.small_names:
            g = self._small_of(name)
            return g if rows is None else g[rows]
        return self._materialise(name, rows)

    def _small_of(self, name: str) -> Tensor:
        """:meth:`_small_samples` of ``name``, formed once per batch."""
        g = self._small.get(name)
        if g is None:
            g = self._small[name] = self._small_samples(name)
        return g

    def _fold_scale(self, c: Tensor) -> Tensor:
        """The clip factors times the loss scale ``s``, each rounded toward zero (never above the
        exact ``c_i·s``): :meth:`_weighted_sum` applies them to the unscaled output gradients, so
        ``s`` costs no pass over them and a unit can only be over-clipped by the rounding."""
        if self.loss_scale == 1.0:
            return c
        folded = c * self.loss_scale
        return torch.nextafter(folded, torch.zeros_like(folded))

    def _scale_bound(self) -> float:
        """Relative enlargement that keeps a bound on ``s``-scaled values an upper bound of the
        exact ones: ``s`` (or ``s²``) rounded to the dtype and one product, at most 3 roundings
        on a squared norm (1 when ``s = 1``: nothing is scaled)."""
        if self.loss_scale == 1.0:
            return 1.0
        return 1.0 + 3 * self.unit_roundoff

    def _exact(self, name: str, centre: Tensor | None, scale: Any, rows: Tensor) -> Tensor:
        """Direct bounds for the units ``rows`` (centre and scale as :meth:`_as_matrix` gives them)."""
        return self._exact_rows(name, centre, scale, rows)

    # ------------------------------------------------------------------ what a layer type supplies
    def _capture(self, captures: list[tuple[Tensor, Tensor]]) -> None:
        raise NotImplementedError

    def _small_samples(self, name: str) -> Tensor:
        """The ``(n, ...)`` per-example gradients of a parameter of :attr:`small_names` (the loss
        scale ``s`` included)."""
        raise NotImplementedError

    def _as_matrix(self, t: Any) -> Any:
        """A centre or scale in the layout the ghost forms use (e.g. a convolution's weight as a matrix)."""
        return t

    def _terms(self, name: str, d: Any, centre: Tensor | None, scale: Any, scalar: bool) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _exact_rows(self, name: str, centre: Tensor | None, scale: Any, rows: Tensor) -> Tensor:
        raise NotImplementedError

    def _weighted_sum(self, name: str, cs: Tensor, keep: Tensor, dropped: bool) -> Tensor:
        """``Σ_i c_i g_i`` from the captured (unscaled) tensors; ``cs`` are the clip factors with the
        loss scale folded in (:meth:`_fold_scale`), ``keep`` the units with ``c_i > 0`` (with
        ``dropped``, the others' rows must be set to 0, not multiplied)."""
        raise NotImplementedError

    def _materialise(self, name: str, rows: Tensor | None) -> Tensor:
        raise NotImplementedError


def build_layers(
    kinds: Mapping[nn.Module, str], captures: Mapping[nn.Module, list[tuple[Any, ...]]], dtype: torch.dtype, mode: str
) -> dict[nn.Module, GhostLayer]:
    """One step's ghost layers: for each module of ``kinds`` with captured calls, the
    :class:`GhostLayer` of its kind over them (modules with no captured call are left out)."""
    u = _transform.unit_roundoff(dtype)
    return {
        m: GhostLayer(m, kind, captures[m], dtype, mode, unit_roundoff=u) for m, kind in kinds.items() if captures.get(m)
    }
