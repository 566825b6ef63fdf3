"""Ghost norms: clip without storing per-example gradients of ``nn.Linear`` / ``nn.Embedding`` (and convolutions).

Every strategy of the affine family needs, per unit i and tensor k, the squared transformed
norm ``‖(g_i − a)/b‖²`` and, once the clip factors ``c_i`` are known, the clipped sum
``Σ_i c_i (g_i − a)/b = (Σ_i c_i g_i − (Σ_i c_i) a)/b`` (the same identity
:func:`adaclip.transform.clipped_sum` uses). With ``D = 1/b²`` (a scalar or shaped like the
parameter) the norm expands to

.. math::
    ‖(g_i − a)/b‖² = Σ D g_i² − 2 Σ (D a) g_i + Σ D a²,

and for layers whose per-example gradient is a product of what the hooks saw, these sums are
matrix products over the batch:

* ``nn.Linear`` weight, input ``x_i`` (T positions × in), output gradient ``e_i`` (T × out),
  ``g_i = Σ_t e_{it} x_{it}ᵀ``. For T = 1: ``Σ D g_i² = (e_i²)ᵀ D (x_i²)`` (with scalar D:
  ``D‖e_i‖²‖x_i‖²``; with ``D = u vᵀ`` of rank one: ``(e_i²·u)(x_i²·v)``, as cheap as the
  scalar case) and ``Σ (Da) g_i = e_iᵀ (Da) x_i`` for any T (sum over t). For T > 1 and
  scalar D: ``Σ g_i² = Σ_{t,s} (x_t·x_s)(e_t·e_s)`` (Gram matrices, cost ~T²(in+out)); the
  same on rescaled outputs and inputs when ``D = u vᵀ`` has rank one (the factored pooling's
  scale ``b ∝ (r ⊗ c)^{1/4}`` while no clamp bites, or a per-tensor one): ``Σ D g_i² =
  Σ_{t,s} (ẽ_t·ẽ_s)(x̃_t·x̃_s)`` with ``ẽ = √u ⊙ e``, ``x̃ = √v ⊙ x``, with or without a centre. For T > 1 with a general
  per-coordinate D (AdaCliP) no cheaper formula exists, so the layer's per-example
  gradients are formed *transiently*, a chunk of the batch at a time, and dropped after the
  norm. ``Σ_i c_i g_i = Eᵀ diag(c) X`` (one matrix product). The bias (``g_i = Σ_t e_{it}``,
  (n, out)) is small and handled as a materialised tensor.
* ``nn.Embedding`` weight, token ids ``t_{il}``, output gradients ``e_{il}``: row v of ``g_i`` is
  ``Σ_{l: t_{il}=v} e_{il}`` (zero at ``padding_idx``). The distinct (example, token) pairs are
  grouped once (``torch.unique``), their summed rows ``S`` give
  ``Σ D g_i² = Σ_rows D[v] S²`` and ``Σ (Da) g_i = Σ_rows (Da)[v] S``; the clipped sum is an
  ``index_add`` of ``c_i e_{il}`` into row ``t_{il}``.

* ``transformers``' ``Conv1D`` (GPT-2; ``y = x W + b`` with ``W`` of shape ``(in, out)``): the
  Linear forms on the transposed weight (kind ``"linear_t"``): the centre and scale are
  transposed in, the sums and per-example gradients transposed out; norms are unchanged by the
  transposition.
* ``nn.Conv1d`` / ``nn.Conv2d`` (``groups=1``, any padding mode, stride, dilation): a Linear
  layer on the unfolded input patches (``x_{it}`` = the patch of output pixel t, C_in·K long;
  ``e_{it}`` = the output gradient there), so the Linear forms above apply with T = the number
  of output pixels and the weight seen as a ``(C_out, C_in·K)`` matrix. Only in
  ``per_sample_mode="ghost"`` (see :func:`ghost_modules`).

Each form lives with its layer type's per-sample rule, registered together
(``register_grad_sampler(nn.Linear, ghost=LinearGhost)``): :mod:`~adaclip_torch.grad_sample.linear`
(also the rank-one factorisation), :mod:`~adaclip_torch.grad_sample.embedding`,
:mod:`~adaclip_torch.grad_sample.hf` and :mod:`~adaclip_torch.grad_sample.conv`, each a subclass
of :class:`~adaclip_torch.grad_sample.ghost_layer.GhostLayer`, which holds what they share (the
upper bound, the exact recomputation of loose units, full float32 products). This module selects
the modules (:func:`ghost_modules`) and handles tied weights (:class:`TiedGhost`); a new layer
type is one file registering both rules, nothing here changes.

Calls of one module several times in a forward pass (an unrolled RNN cell) are concatenated
along the position axis (their contributions add up per example, exactly like positions). A
parameter shared by several modules (tied weights) is not eligible by itself (:func:`ghost_modules`):
its per-example gradient is a sum over modules whose cross terms the formulas above do not
cover. When every module using it is an ``nn.Linear`` or ``nn.Embedding`` using it as its weight
(tied input/output embeddings), it takes the ghost path as a :class:`TiedGhost`, whose norm adds
the cross terms ``2⟨g_i^{(m)}, g_i^{(m')}⟩`` (cheap forms, with their rounding bounds) to the
modules' own ghost norms (:func:`tied_ghost_groups`); any other shared parameter keeps the
materialised path. A module covered by the :mod:`torch.func` fallback of a parent that owns
parameters itself (ViT's patch-embedding ``Conv2d`` inside ``ViTEmbeddings``, which owns the
class token and the position embeddings) is not captured either: the parent's fallback forms the
per-example gradients of its whole subtree, so it is materialised. Calls whose input does not
carry the batch (:mod:`adaclip_torch.grad_sample.batch_free`) are captured like batched ones: the
hooks hand the input expanded to the batch and the routed per-example output gradients.
Everything is computed in the statistics dtype (float32 at least).

Numerical safety: the expansion subtracts nearly equal numbers when the centre is large
compared with a unit's deviation from it (``‖a/b‖ ≫ ‖(g − a)/b‖``), and a float32 norm can
then come out far too small — the unit would be under-clipped. :meth:`GhostLayer.norm` therefore
returns an *upper bound*: the estimate plus a bound on its rounding error (each term's
magnitude times the margin of its reductions, :func:`adaclip.transform.rounding_margin`), and
recomputes a unit's norm directly from its materialised gradient where that error term would
over-clip it by more than :data:`OVERCLIP_TOLERANCE`. Rounding can only over-clip.
These bounds assume IEEE float32 products: :meth:`GhostLayer.norm`, :meth:`GhostLayer.weighted_sum`
and the same of :class:`TiedGhost` run with float32 matrix products in full precision whatever the
user's ``torch.set_float32_matmul_precision`` or TF32 settings
(:class:`~adaclip_torch._precision.full_float32_precision`, which explains why).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from adaclip import transform as _transform
from adaclip.errors import InvalidGradientError

from ._precision import full_float32_precision
from .grad_sample import ghost_layer as _ghost_layer
from .grad_sample.ghost_layer import (
    GHOST_KINDS,
    OVERCLIP_TOLERANCE,
    GhostLayer,
    GhostSource,
    is_scalar,
    margin,
)
from .grad_sample.linear import RANK_ONE_ROUNDINGS
from .grad_sample.registry import get_grad_sampler

__all__ = [
    "PER_SAMPLE_MODES",
    "OVERCLIP_TOLERANCE",
    "RANK_ONE_ROUNDINGS",
    "ghost_kind",
    "ghost_modules",
    "tied_ghost_groups",
    "GhostLayer",
    "TiedGhost",
]

PER_SAMPLE_MODES = ("materialise", "ghost", "auto")
Tensor = torch.Tensor


def ghost_kind(module: nn.Module) -> str | None:
    """The ghost kind of ``module`` (``"linear"``, ``"linear_t"``, ``"conv"``, ``"embedding"``,
    or a registered one): its registered rule has a ghost form that serves it
    (:meth:`GhostLayer.applies`), else ``None``."""
    rule = get_grad_sampler(module)
    if rule is None or rule.ghost is None or not rule.ghost.applies(module):
        return None
    return rule.ghost.kind


def _memory_mode_only(kind: str) -> bool:
    return GHOST_KINDS[kind].memory_mode_only


def ghost_modules(
    model: nn.Module,
    params: Sequence[Tensor],
    *,
    convolutions: bool = False,
    hooked: Collection[nn.Module] | None = None,
) -> dict[nn.Module, str]:
    """Modules of ``model`` whose parameters can take the ghost path: those whose registered
    rule comes with a ghost form that serves them (:func:`ghost_kind`: ``nn.Linear`` /
    ``nn.Embedding`` / ``transformers``' ``Conv1D``, and, with ``convolutions=True``, the forms
    kept for the memory mode: ``nn.Conv1d`` / ``nn.Conv2d`` with ``groups=1``), whose every
    parameter belongs to no other module (no tied weights) and whose trainable parameters are all
    in ``params``. ``hooked``: the modules the grad-sample hooks run through their rule
    (:attr:`~adaclip_torch.grad_sample.GradSampleHooks.ruled_modules`); a module outside it — one
    covered by a parent's :mod:`torch.func` fallback — is left to the materialised path.

    Convolutions take the ghost path only in ``per_sample_mode="ghost"`` (the memory mode): on
    the benchmark CNN (``benchmarks/speed_torch.py``) their Gram form is dearer than forming the
    per-example gradients (T² (C·K + C_out) > C·K·C_out for a first layer with many output
    pixels), so ``"auto"`` keeps materialising them."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    wanted = {id(p) for p in params}
    out: dict[nn.Module, str] = {}
    for m in model.modules():
        kind = ghost_kind(m)
        if kind is None or (_memory_mode_only(kind) and not convolutions) or (hooked is not None and m not in hooked):
            continue
        own = [p for p in m._parameters.values() if p is not None]
        if any(owners[id(p)] > 1 for p in own):
            continue
        trainable = [p for p in own if p.requires_grad]
        if not trainable or any(id(p) not in wanted for p in trainable):
            continue
        out[m] = kind
    return out


# ---------------------------------------------------------------------------------- tied weights
def tied_ghost_groups(
    model: nn.Module, params: Sequence[Tensor], *, hooked: Collection[nn.Module] | None = None
) -> list[tuple[Tensor, list[tuple[nn.Module, str]]]]:
    """Parameters shared by several modules that can take the ghost path *together*
    (:class:`TiedGhost`): ``[(parameter, [(module, name), ...]), ...]``.

    A shared parameter qualifies when it is trainable and in ``params``, every module holding it
    holds it as its ``weight`` and is an ``nn.Linear`` or ``nn.Embedding`` with its built-in rule
    (captured by the hooks: in ``hooked`` if given), and those modules' other trainable parameters
    are all in ``params`` and shared with no other module. Typical: tied input/output embeddings
    (GPT-2's ``wte``/``lm_head``; T5's ``shared`` read by both embeddings and the LM head). Any
    other shared parameter stays on the materialised path."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    wanted = {id(p) for p in params}
    out = []
    for p in params:
        holders = owners.get(id(p), [])
        if len(holders) < 2 or not p.requires_grad:
            continue
        ok = True
        for m, name in holders:
            if name != "weight" or ghost_kind(m) not in ("linear", "embedding") or (hooked is not None and m not in hooked):
                ok = False
                break
            for other, q in m._parameters.items():
                if other == name or q is None or not q.requires_grad:
                    continue
                if id(q) not in wanted or len(owners[id(q)]) > 1:
                    ok = False
        if ok:
            out.append((p, holders))
    return out


class TiedGhost(GhostSource):
    """One parameter used by several ghost modules (tied weights): example i's gradient is the
    **sum** of its gradients through every use, ``g_i = Σ_m g_i^{(m)}``, and

    .. math::
        ‖g_i‖^2 = \\sum_m ‖g_i^{(m)}‖^2 + 2 \\sum_{m < m'} ⟨g_i^{(m)}, g_i^{(m')}⟩ .

    The squares are the modules' own ghost norms (:meth:`GhostLayer.norm`, upper bounds); the
    cross terms have cheap forms on what the hooks captured, for a weight ``W`` of shape
    ``(V, d)`` (token ids ``t``, embedding output gradients ``δ``; Linear inputs ``x``, output
    gradients ``e``, both per example):

    * Embedding × Linear: ``Σ_{l,s} e_{s, t_l} (x_s · δ_l)`` — the Linear's gradient row
      ``t_l`` is ``Σ_s e_{s,t_l} x_s``, and the embedding's gradient is ``δ_l`` placed at row
      ``t_l``; cost ``T·L·d`` per example;
    * Embedding × Embedding: ``Σ_{l,l'} [t_l = t'_{l'}] (δ_l · δ'_{l'})``;
    * Linear × Linear: ``Σ_{s,s'} (e_s · e'_{s'})(x_s · x'_{s'})``,

    (``padding_idx`` rows excluded: their gradient is 0). Each is computed with a bound on its
    rounding error (the margin of its reductions times the sum of the absolute values of its
    terms), added to the total — so the result is an upper bound of the exact squared norm, and
    a unit can only be over-clipped. Without the cross terms the per-module norms could
    under-estimate the norm (or over-estimate it: the uses may cancel); they are never skipped.

    This form serves a scalar scale without centre (flat, per-layer, scaled, quantile
    clipping, the automatic rule). With a centre or a per-coordinate scale (AdaCliP), and for
    units whose bound is loose (its error terms above :data:`OVERCLIP_TOLERANCE` of it: the
    uses nearly cancel), the norm is computed directly from the unit's materialised gradient,
    a chunk of units at a time (memory: one chunk of ``(V, d)`` gradients, not n of them).
    ``weighted_sum`` is the sum of the modules' weighted sums; nothing ``(n, V, d)`` is formed.
    """

    def __init__(self, parts: list[tuple[GhostLayer, str]]) -> None:
        if not parts:
            raise InvalidGradientError("TiedGhost needs at least one captured use")
        self.parts = parts
        self.n = parts[0][0].n
        self.dtype = parts[0][0].dtype
        self.shape = tuple(parts[0][0].module.get_parameter(parts[0][1]).shape)

    def materialise(self, name: str, rows: Tensor | None = None) -> Tensor:
        """Per-example gradients ``(n, *shape)`` (of the units ``rows`` only, if given)."""
        total: Tensor | None = None
        for layer, pname in self.parts:
            g = layer.materialise(pname, rows).reshape(-1, *self.shape)
            total = g if total is None else total + g
        assert total is not None
        return total

    def weighted_sum(self, name: str, c: Tensor) -> Tensor:
        """:meth:`weighted_sum_within_guard` under :class:`full_float32_precision`."""
        with full_float32_precision():
            return self.weighted_sum_within_guard(name, c)

    def norm(self, name: str, centre: Tensor | None, scale: Any) -> Tensor:
        """:meth:`norm_within_guard` under :class:`full_float32_precision`."""
        with full_float32_precision():
            return self.norm_within_guard(name, centre, scale)

    def weighted_sum_within_guard(self, name: str, c: Tensor) -> Tensor:
        """``Σ_i c_i g_i``: the sum of every use's weighted sum (units with ``c_i = 0`` dropped);
        the caller holds :class:`full_float32_precision`."""
        total: Tensor | None = None
        for layer, pname in self.parts:
            w = layer.weighted_sum_within_guard(pname, c).reshape(self.shape)
            total = w if total is None else total + w
        assert total is not None
        return total

    def norm_within_guard(self, name: str, centre: Tensor | None, scale: Any) -> Tensor:
        """An upper bound of ``‖(g_i − centre)/scale‖²``, shape ``(n,)`` (class doc); the caller
        holds :class:`full_float32_precision`."""
        if len(self.parts) == 1:
            layer, pname = self.parts[0]
            return layer.norm_within_guard(pname, centre, scale)
        if centre is not None or not is_scalar(scale):
            return self._exact(centre, scale, torch.arange(self.n, device=self._device()))
        d = 1.0 / (scale * scale)
        u = _transform.unit_roundoff(self.dtype)
        squares = [layer.norm_within_guard(pname, None, scale) for layer, pname in self.parts]
        cross = torch.zeros(self.n, dtype=self.dtype, device=self._device())
        error = torch.zeros_like(cross)
        for a in range(len(self.parts)):
            for b in range(a + 1, len(self.parts)):
                x, err = self._cross(self.parts[a][0], self.parts[b][0])
                cross = cross + 2.0 * d * x
                error = error + 2.0 * d * err * (1.0 + 4 * u)
        square_sum = torch.stack(squares).sum(0)
        k = len(squares) + 2
        # the additions' own rounding: at most (k + 2)·u of the sum of the absolute values
        error = error + (k + 2) * u * (square_sum + cross.abs() + error)
        bound = (square_sum + cross + error).clamp_min(0.0)
        loose = error > OVERCLIP_TOLERANCE * bound  # False for NaN: a non-finite unit stays so
        if bool(loose.any()):
            rows = torch.nonzero(loose).reshape(-1)
            bound = bound.index_copy(0, rows, self._exact(None, scale, rows))
        return bound

    def _device(self) -> torch.device:
        return self.parts[0][0].e.device

    def _exact(self, centre: Tensor | None, scale: Any, rows: Tensor) -> Tensor:
        """Direct bounds for the units ``rows`` from their materialised gradients, a chunk at a time.

        The uses' gradients come out multiplied by their loss scale ``s`` (rounded), while the
        weighted sum applies ``s`` through the clip factors: the bound is enlarged by the largest
        use's :meth:`GhostLayer._scale_bound` so that it holds for the exact ``s``-scaled values."""
        chunk = max(1, _ghost_layer.CHUNK_ELEMENTS // max(1, math.prod(self.shape)))
        parts = []
        for s in range(0, int(rows.shape[0]), chunk):
            g = self.materialise("weight", rows[s : s + chunk])
            parts.append(_transform.transformed_sq_norms([g], None if centre is None else [centre], [scale])[0])
        if not parts:
            return torch.zeros(0, dtype=self.dtype, device=self._device())
        enlarge = max(layer._scale_bound() for layer, _ in self.parts)
        out = torch.cat(parts)
        return out if enlarge == 1.0 else out * enlarge

    def _cross(self, a: GhostLayer, b: GhostLayer) -> tuple[Tensor, Tensor]:
        """``(⟨g^{(a)}_i, g^{(b)}_i⟩, a bound on its rounding error)`` per example, unscaled by
        ``D``: the forms on the captured gradients, times both layers' loss scales."""
        value, error = self._cross_captured(a, b)
        both = a.loss_scale * b.loss_scale
        if both == 1.0:
            return value, error
        u = _transform.unit_roundoff(self.dtype)
        value = value * both  # the product rounded to the dtype, and its product: 2u of |value|
        return value, error * both * (1.0 + 3 * u) + 3 * u * value.abs()

    def _cross_captured(self, a: GhostLayer, b: GhostLayer) -> tuple[Tensor, Tensor]:
        """:meth:`_cross` on the captured (loss-scaled) gradients."""
        u = _transform.unit_roundoff(self.dtype)
        if a.kind == "linear" and b.kind == "embedding":
            a, b = b, a
        if a.kind == "embedding" and b.kind == "embedding":
            ea, eb = a.e * a._keep().reshape(a.e.shape[:2])[..., None], b.e * b._keep().reshape(b.e.shape[:2])[..., None]
            same = (a.ids[:, :, None] == b.ids[:, None, :]).to(self.dtype)
            dots = torch.bmm(ea, eb.transpose(1, 2))
            value = (same * dots).sum(dim=(1, 2))
            magnitude = (same * (ea.norm(dim=2)[:, :, None] * eb.norm(dim=2)[:, None, :])).sum(dim=(1, 2))
            return value, (margin(self.dtype, ea.shape[2], same.shape[1] * same.shape[2]) + 4 * u) * magnitude
        if a.kind == "embedding":  # b linear: weight (V, d) = (out, in)
            delta = a.e * a._keep().reshape(a.e.shape[:2])[..., None]  # (n, L, d)
            n, length = a.ids.shape
            positions = b.x.shape[1]
            picked = b.e.gather(2, a.ids[:, None, :].expand(n, positions, length))  # (n, T, L): e_{s, t_l}
            dots = torch.bmm(b.x, delta.transpose(1, 2))  # (n, T, L): x_s · δ_l
            value = (picked * dots).sum(dim=(1, 2))
            norms = b.x.norm(dim=2)[:, :, None] * delta.norm(dim=2)[:, None, :]
            magnitude = (picked.abs() * norms).sum(dim=(1, 2))
            return value, (margin(self.dtype, delta.shape[2], positions * length) + 4 * u) * magnitude
        # linear × linear
        gram_e = torch.bmm(a.e, b.e.transpose(1, 2))
        gram_x = torch.bmm(a.x, b.x.transpose(1, 2))
        value = (gram_e * gram_x).sum(dim=(1, 2))
        magnitude = (a.x.norm(dim=2) * a.e.norm(dim=2)).sum(dim=1) * (b.x.norm(dim=2) * b.e.norm(dim=2)).sum(dim=1)
        total_margin = margin(self.dtype, a.e.shape[2], a.x.shape[2], gram_e.shape[1] * gram_e.shape[2]) + 4 * u
        return value, total_margin * magnitude
