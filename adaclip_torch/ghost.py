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
from .grad_sample.conv import conv1d_grad_sample, conv2d_grad_sample, unfold_patches
from .grad_sample.embedding import embedding_grad_sample
from .grad_sample.hf import conv1d_grad_sample as hf_conv1d_grad_sample
from .grad_sample.linear import linear_grad_sample
from .grad_sample.registry import get_grad_sampler

__all__ = [
    "PER_SAMPLE_MODES",
    "OVERCLIP_TOLERANCE",
    "RANK_ONE_ROUNDINGS",
    "ghost_modules",
    "tied_ghost_groups",
    "GhostLayer",
    "TiedGhost",
]

PER_SAMPLE_MODES = ("materialise", "ghost", "auto")
Tensor = torch.Tensor
# elements of one transient chunk of per-example gradients (AdaCliP on sequence Linear layers)
_CHUNK_ELEMENTS = 1 << 22


def _square_sum(t: Tensor) -> Tensor:
    """``Σ t²`` as one dot product (no temporary of ``t``'s size when ``t`` is contiguous)."""
    flat = t.reshape(-1)
    return torch.dot(flat, flat)


def _kind(module: nn.Module) -> str | None:
    rule = get_grad_sampler(module)
    if rule is None:
        return None
    if rule.fn is linear_grad_sample and isinstance(module, nn.Linear):
        return "linear"
    if rule.fn is embedding_grad_sample and isinstance(module, nn.Embedding):
        return "embedding"
    if rule.fn is hf_conv1d_grad_sample and getattr(module, "weight", None) is not None and module.weight.ndim == 2:
        return "linear_t"
    conv = (rule.fn is conv1d_grad_sample and type(module) is nn.Conv1d) or (
        rule.fn is conv2d_grad_sample and type(module) is nn.Conv2d
    )
    if conv and module.groups == 1:
        return "conv"
    return None


def ghost_modules(
    model: nn.Module,
    params: Sequence[Tensor],
    *,
    convolutions: bool = False,
    hooked: Collection[nn.Module] | None = None,
) -> dict[nn.Module, str]:
    """Modules of ``model`` whose parameters can take the ghost path: ``nn.Linear`` /
    ``nn.Embedding`` / ``transformers``' ``Conv1D`` (and, with ``convolutions=True``,
    ``nn.Conv1d`` / ``nn.Conv2d`` with ``groups=1``), with their built-in rule, whose every
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
        kind = _kind(m)
        if kind is None or (kind == "conv" and not convolutions) or (hooked is not None and m not in hooked):
            continue
        own = [p for p in m._parameters.values() if p is not None]
        if any(owners[id(p)] > 1 for p in own):
            continue
        trainable = [p for p in own if p.requires_grad]
        if not trainable or any(id(p) not in wanted for p in trainable):
            continue
        out[m] = kind
    return out


def _is_scalar(scale: Any) -> bool:
    """Whether a scale ``b`` is one number for the whole tensor: a Python float (flat
    clipping's ``C``) or a 0-d tensor (a clip norm kept in the state, the quantile rule's ``C_t``)."""
    return not isinstance(scale, Tensor) or scale.ndim == 0


#: How far (relative, in units of the dtype's unit roundoff) ``D = 1/b²`` may exceed its rank-one
#: factorisation for a sequence ``nn.Linear`` to take the Gram form (:func:`_rank_one`). The
#: factored pooling's scale is rank one up to a few roundings; a clamp that bites breaks it.
RANK_ONE_ROUNDINGS = 256


def _rank_one(d: Tensor) -> tuple[Tensor, Tensor, float] | None:
    """``(u, v, κ)`` with ``(1 − ρ)·u vᵀ ≤ D ≤ κ·u vᵀ`` elementwise, ``κ ≤ 1 + ρ``
    (``ρ = RANK_ONE_ROUNDINGS·u_r``), for a positive finite ``(out, in)`` weight ``D``; ``None``
    if ``D`` is not rank one up to rounding.

    ``u = D[:, 0]``, ``v = D[0, :]/D[0, 0]`` and ``κ`` the largest computed ``D/(u vᵀ)`` enlarged
    by 8 roundings (the ratio's own division and product), so the bound holds for the exact
    values: the Gram form from ``(u, v)`` times ``κ`` can only over-estimate ``Σ D g²``."""
    if d.ndim != 2 or d.numel() == 0:
        return None
    if d.shape[0] > 1:
        # quick rejection of a general per-coordinate D (AdaCliP's coordinate pooling), on two
        # rows only: for a rank-one D the ratio of its last row to its first is constant
        ratio = d[-1] / d[0]
        lo, hi = float(ratio.min()), float(ratio.max())
        if not (math.isfinite(lo) and math.isfinite(hi) and lo > 0 and hi <= lo * (1.0 + 2 * RANK_ONE_ROUNDINGS * _transform.unit_roundoff(d.dtype))):
            return None
    rows = d[:, 0]
    cols = d[0, :] / d[0, 0]
    if not bool(((rows > 0) & torch.isfinite(rows)).all() and ((cols > 0) & torch.isfinite(cols)).all()):
        return None
    # two passes over D: the ratio (in place) and its extremes; a NaN, inf, zero or negative entry of
    # D makes an extreme non-finite or non-positive, which the tests below refuse
    ratio = (d / rows[:, None]).div_(cols[None, :])
    best_t, worst_t = torch.aminmax(ratio)
    worst, best = float(worst_t), float(best_t)
    ur = _transform.unit_roundoff(d.dtype)
    if not (math.isfinite(worst) and math.isfinite(best) and best > 0):
        return None
    kappa = max(1.0, worst) * (1.0 + 8 * ur)
    # both ways: D ≤ κ·u vᵀ makes the Gram form an upper bound, D ≥ (1 − tol)·u vᵀ keeps it tight
    if not math.isfinite(kappa) or kappa - 1.0 > RANK_ONE_ROUNDINGS * ur or 1.0 - best > RANK_ONE_ROUNDINGS * ur:
        return None
    return rows, cols, kappa


#: Largest relative over-clip the ghost bound may cause before a unit's norm is recomputed
#: exactly (see :meth:`GhostLayer.norm`).
OVERCLIP_TOLERANCE = 1e-2


def _margin(dtype: torch.dtype, *lengths: int) -> float:
    """Rounding margin of a nested reduction: the sum of each level's blocked-summation bound."""
    return sum(_transform.rounding_margin(dtype, k) for k in lengths)


class GhostLayer:
    """The captured calls of one ghost module in one (accumulated) batch.

    ``norm(name, centre, scale)`` gives an *upper bound* of the ``(n,)`` squared transformed
    norms of parameter ``name``; ``weighted_sum(name, c)`` gives ``Σ_i c_i g_i`` (units with
    ``c_i = 0`` contribute exactly 0, whatever their entries); ``materialise(name)`` the
    ``(n, *shape)`` per-example gradients (used only where the ghost path does not apply,
    e.g. grouping by user).

    Inputs and output gradients with NaN/inf entries are kept as they are: such a unit's norm
    comes out non-finite, the core gives it the clip factor 0 and :meth:`weighted_sum` drops it.
    """

    def __init__(self, module: nn.Module, kind: str, captures: list[tuple[Tensor, Tensor]], dtype: torch.dtype, mode: str):
        self.module = module
        self.kind = kind
        self.mode = mode
        self.dtype = dtype
        n = int(captures[0][1].shape[0])
        if kind == "conv":
            # a convolution is a Linear layer on its unfolded patches: positions = output pixels
            spatial = 1 if isinstance(module, nn.Conv1d) else 2
            xs, es = [], []
            for x, e in captures:
                if x.dim() != spatial + 2:
                    raise InvalidGradientError(
                        f"{type(module).__name__} input of shape {tuple(x.shape)} is not batched"
                    )
                xs.append(unfold_patches(module, x, spatial).transpose(1, 2).to(dtype))
                es.append(e.reshape(n, module.out_channels, math.prod(e.shape[2:])).transpose(1, 2).to(dtype))
                if xs[-1].shape[1] != es[-1].shape[1]:
                    raise InvalidGradientError(
                        f"{type(module).__name__}: {xs[-1].shape[1]} unfolded positions but an output "
                        f"gradient with {es[-1].shape[1]}; the module's forward is not a standard convolution"
                    )
            self.x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)
            self.e = es[0] if len(es) == 1 else torch.cat(es, dim=1)
            self.in_f, self.out_f = self.x.shape[2], module.out_channels
        elif kind in ("linear", "linear_t"):
            # linear_t (transformers' Conv1D): weight (in, out), the same Linear forms transposed
            in_f, out_f = (module.in_features, module.out_features) if kind == "linear" else module.weight.shape
            xs, es = [], []
            for x, e in captures:
                if x.dim() < 2:
                    raise InvalidGradientError(
                        f"{type(module).__name__} input of shape {tuple(x.shape)} has no batch dimension"
                    )
                length = math.prod(x.shape[1:-1])  # positions per example (1 without sequence dims)
                xs.append(x.reshape(n, length, in_f).to(dtype))
                es.append(e.reshape(n, length, out_f).to(dtype))
            self.x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)
            self.e = es[0] if len(es) == 1 else torch.cat(es, dim=1)
            self.in_f, self.out_f = int(in_f), int(out_f)
        else:
            ids = [t.reshape(n, math.prod(t.shape[1:])).long() for t, _ in captures]
            es = [e.reshape(n, math.prod(t.shape[1:]), module.embedding_dim).to(dtype) for t, e in captures]
            self.ids = ids[0] if len(ids) == 1 else torch.cat(ids, dim=1)
            self.e = es[0] if len(es) == 1 else torch.cat(es, dim=1)
            self._groups: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self.n = n
        self._bias: Tensor | None = None

    # ------------------------------------------------------------------ shared
    def materialise(self, name: str, rows: Tensor | None = None) -> Tensor:
        """Per-example gradients of ``name`` (of the units ``rows`` only, if given)."""
        if self.kind != "embedding":
            if name == "bias":
                b = self.bias_samples()
                return b if rows is None else b[rows]
            g = self._weight_samples(rows)
            if self.kind == "linear_t":
                return g.transpose(1, 2)
            return g if self.kind == "linear" else g.reshape(g.shape[0], *self.module.weight.shape)
        ids, e = (self.ids, self.e) if rows is None else (self.ids[rows], self.e[rows])
        return embedding_grad_sample(self.module, (ids,), e)["weight"].to(self.dtype)

    def _weight_samples(self, rows: Tensor | None = None) -> Tensor:
        """``(n, out, in)`` per-example weight gradients ``e_iᵀ x_i`` (Linear, or Conv on patches)."""
        e, x = (self.e, self.x) if rows is None else (self.e[rows], self.x[rows])
        return torch.bmm(e.transpose(1, 2), x)

    def _as_matrix(self, t: Any) -> Any:
        """A Conv weight's centre or scale as the ``(out, C_in·K)`` matrix of the patch form; a
        ``Conv1D`` weight's (``(in, out)``) transposed to the ``(out, in)`` of the Linear forms."""
        if self.kind == "conv" and isinstance(t, Tensor) and t.ndim > 2:
            return t.reshape(self.out_f, self.in_f)
        if self.kind == "linear_t" and isinstance(t, Tensor) and t.ndim == 2:
            return t.T
        return t

    def bias_samples(self) -> Tensor:
        if self._bias is None:
            self._bias = self.e.sum(dim=1)
        return self._bias

    @full_float32_precision()
    def norm(self, name: str, centre: Tensor | None, scale: Any) -> Tensor:
        """An upper bound of ``‖(g_i − centre)/scale‖²``, shape ``(n,)``.

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
        if self.kind != "embedding" and name == "bias":
            return self._direct(self.bias_samples(), centre, scale)
        centre, scale = self._as_matrix(centre), self._as_matrix(scale)
        scalar = _is_scalar(scale)
        d = 1.0 / (scale * scale)
        if self.kind != "embedding":
            estimate, error = self._linear_terms(d, centre, scale, scalar)
        else:
            estimate, error = self._embedding_terms(d, centre, scalar)
        bound = (estimate + error).clamp_min(0.0)
        loose = error > OVERCLIP_TOLERANCE * bound  # False for NaN: a non-finite unit stays so
        if bool(loose.any()):
            rows = torch.nonzero(loose).reshape(-1)
            bound = bound.index_copy(0, rows, self._exact(name, centre, scale, rows))
        return bound

    def _direct(self, g: Tensor, centre: Tensor | None, scale: Any) -> Tensor:
        """The core's bound on materialised gradients (no expansion, no cancellation)."""
        return _transform.transformed_sq_norms([g], None if centre is None else [centre], [scale])[0]

    def _exact(self, name: str, centre: Tensor | None, scale: Any, rows: Tensor) -> Tensor:
        """Direct bounds for the units ``rows``, from their materialised gradients (linear) or
        from their distinct rows plus the centre's mass elsewhere (embedding)."""
        if self.kind != "embedding":  # weights only (the bias never needs it); centre/scale as matrices
            chunk = max(1, _CHUNK_ELEMENTS // max(1, self.in_f * self.out_f))
            parts = [self._direct(self._weight_samples(rows[s : s + chunk]), centre, scale)
                     for s in range(0, int(rows.shape[0]), chunk)]  # fmt: skip
            return torch.cat(parts) if parts else torch.zeros(0, dtype=self.dtype, device=self.e.device)
        return self._embedding_exact(centre, scale, rows)

    @full_float32_precision()
    def weighted_sum(self, name: str, c: Tensor) -> Tensor:
        """``Σ_i c_i g_i`` shaped like the parameter; units with ``c_i = 0`` are dropped."""
        c = c.to(self.dtype)
        keep = c > 0
        dropped = not bool(keep.all())
        if self.kind != "embedding":
            if name == "bias":
                b = self.bias_samples()
                return c @ (torch.where(keep[:, None], b, 0.0) if dropped else b)
            e, x = self.e, self.x
            if dropped:
                e = torch.where(keep[:, None, None], e, 0.0)
                x = torch.where(keep[:, None, None], x, 0.0)
            ce = e * c[:, None, None]
            w = ce.reshape(-1, self.out_f).T @ x.reshape(-1, self.in_f)
            if self.kind == "linear_t":
                return w.T
            return w if self.kind == "linear" else w.reshape(self.module.weight.shape)
        num, dim = self.module.num_embeddings, self.module.embedding_dim
        e = torch.where(keep[:, None, None], self.e, 0.0) if dropped else self.e
        mask = self._keep()
        rows = self.ids.reshape(-1)[mask]
        vals = (e * c[:, None, None]).reshape(-1, dim)[mask]
        return torch.zeros(num, dim, dtype=self.dtype, device=self.e.device).index_add_(0, rows, vals)

    # ------------------------------------------------------------------ Linear
    def _linear_terms(self, d: Any, centre: Tensor | None, scale: Any, scalar: bool) -> tuple[Tensor, Tensor]:
        """``(estimate, error bound)`` of the squared transformed norms of the weight.

        Sequences (T > 1) take the Gram form when ``D = 1/b²`` is a scalar or (numerically) of
        rank one, ``D ≤ κ·u vᵀ`` elementwise with ``κ − 1`` within rounding (:func:`_rank_one`:
        the factored pooling's scale ``b ∝ (r ⊗ c)^{1/4}`` while no clamp bites, per-tensor
        pooling, AdaCliP at initialisation): with ``ẽ_t = √u ⊙ e_t`` and ``x̃_t = √v ⊙ x_t``,

        .. math::  Σ_{jk} D_{jk} g_{jk}² ≤ κ \\sum_{t,s} (ẽ_t·ẽ_s)(x̃_t·x̃_s),

        and ``Σ_{t,s}|ẽ_t·ẽ_s||x̃_t·x̃_s| ≤ (Σ_t ‖ẽ_t‖‖x̃_t‖)²`` bounds its rounding error (and,
        with a centre, by Cauchy–Schwarz ``|Σ_t e_tᵀ(D a)x_t|``'s terms: ``√(κ·(Σ_t‖ẽ_t‖‖x̃_t‖)²·Σ D a²)``).
        Otherwise (a general per-coordinate ``D``) the per-example gradients are formed
        transiently, a chunk of the batch at a time (the exact path).

        Without positions (T = 1) the same rank-one bound gives ``Σ D g² ≤ κ (e²·u)(x²·v)``:
        two matrix–vector products, the cost of flat clipping's ``D‖e‖²‖x‖²``, instead of the
        ``(n × out)·(out × in)`` product ``(e² D)·x²`` a general ``D`` needs. With a centre the
        cross term ``Σ_j e_jᵀ(D a)x_j`` is one such product either way.
        """
        x, e = self.x, self.e
        n, t = x.shape[0], x.shape[1]
        in_f, out_f = x.shape[2], e.shape[2]
        u = _transform.unit_roundoff(self.dtype)
        cheap = self.mode == "ghost" or t * (in_f + out_f) <= in_f * out_f
        factors = _rank_one(d) if (cheap and not scalar) else None
        gram = t > 1 and cheap and (scalar or factors is not None)
        if t > 1 and not gram:
            # transient: this layer's per-example gradients, a chunk of the batch at a time, and
            # their norms computed directly (the exact path: nothing to cancel)
            direct = self._exact("weight", centre, scale, torch.arange(n, device=x.device))
            return direct, torch.zeros_like(direct)
        if t == 1:
            x2, e2 = x[:, 0] ** 2, e[:, 0] ** 2
            if scalar:
                sq = d * x2.sum(1) * e2.sum(1)
            elif factors is not None:  # D ≤ κ·u vᵀ: Σ D e² x² ≤ κ (e²·u)(x²·v), as cheap as flat
                rows, cols, kappa = factors
                sq = kappa * (e2 @ rows) * (x2 @ cols)
            else:  # a general per-coordinate D: one (n × out)·(out × in) product
                sq = ((e2 @ d) * x2).sum(1)
            # + 2u: the product with κ and the two factors' product
            sq_margin = _margin(self.dtype, in_f, out_f) + 6 * u
            sq_magnitude = sq  # non-negative terms
        elif factors is None:  # Gram form (scalar D): Σ_{t,s} (x_t·x_s)(e_t·e_s)
            gram_x = torch.bmm(x, x.transpose(1, 2))
            gram_e = torch.bmm(e, e.transpose(1, 2))
            sq = d * (gram_x * gram_e).sum(dim=(1, 2))
            sq_margin = _margin(self.dtype, in_f, out_f, t * t) + 4 * u
            sq_magnitude = d * self._position_norm_sum() ** 2
        else:  # Gram form of D ≤ κ·u vᵀ on ẽ = √u ⊙ e, x̃ = √v ⊙ x (over-estimates by at most κ)
            rows, cols, kappa = factors
            xs, es = x * cols.sqrt(), e * rows.sqrt()
            gram_x = torch.bmm(xs, xs.transpose(1, 2))
            gram_e = torch.bmm(es, es.transpose(1, 2))
            sq = kappa * (gram_x * gram_e).sum(dim=(1, 2))
            # 8u more: the square roots' rounding, (√u)² = u(1 ± 2u) on each side
            sq_margin = _margin(self.dtype, in_f, out_f, t * t) + 12 * u
            sq_magnitude = kappa * ((xs.norm(dim=2) * es.norm(dim=2)).sum(dim=1)) ** 2
        if centre is None:
            return sq, sq_margin * sq_magnitude
        if scalar:  # one number D: multiply the sums, not the centre (no pass over the weight)
            lin = d * ((e @ centre) * x).sum(dim=(1, 2))
            const = d * _square_sum(centre)
        else:
            lin = ((e @ (d * centre)) * x).sum(dim=(1, 2))
            const = (d * centre * centre).sum()
        estimate = sq - 2.0 * lin + const
        # The terms of B = Σ_t e_tᵀ(Da)x_t have absolute sum ≤ √M·√C (Cauchy–Schwarz on √D·e_t x_tᵀ
        # and √D·a, summed over t), M = sq_magnitude ≥ A (for T = 1, M = A); every term's error is
        # at most its margin times (√M + √C)², and the two additions add 2u of (A + 2|B| + C) each.
        upper_sq = sq_magnitude * (1.0 + sq_margin)
        magnitude = (upper_sq.clamp_min(0.0).sqrt() + const.sqrt()) ** 2
        margin = max(sq_margin, _margin(self.dtype, out_f, t * in_f), _margin(self.dtype, in_f * out_f)) + 4 * u
        if scalar:
            margin += 2 * u  # B and C multiplied by D after their sums: one rounding more each
        return estimate, margin * magnitude

    def _position_norm_sum(self) -> Tensor:
        """``Σ_t ‖x_t‖·‖e_t‖`` per example: bounds ``Σ_{t,s} |x_t·x_s||e_t·e_s|`` by its square."""
        return (self.x.norm(dim=2) * self.e.norm(dim=2)).sum(dim=1)

    # ------------------------------------------------------------------ Embedding
    def _keep(self) -> Tensor:
        flat = self.ids.reshape(-1)
        pad = self.module.padding_idx
        return torch.ones_like(flat, dtype=torch.bool) if pad is None else flat != pad

    def _group(self) -> tuple[Tensor, Tensor, Tensor]:
        """Distinct (example, token) pairs: (example of each pair, token of each pair, summed rows)."""
        num, dim = self.module.num_embeddings, self.module.embedding_dim
        n, length = self.ids.shape
        example = torch.arange(n, device=self.ids.device).repeat_interleave(length)
        keep = self._keep()
        keys = (example * num + self.ids.reshape(-1))[keep]
        uniq, inverse = torch.unique(keys, return_inverse=True)
        summed = torch.zeros(uniq.shape[0], dim, dtype=self.dtype, device=self.e.device)
        summed.index_add_(0, inverse, self.e.reshape(-1, dim)[keep])
        return uniq // num, uniq % num, summed

    def _per_example(self, example: Tensor, rows: Tensor) -> Tensor:
        return torch.zeros(self.n, dtype=self.dtype, device=self.e.device).index_add_(0, example, rows)

    def _embedding_terms(self, d: Any, centre: Tensor | None, scalar: bool) -> tuple[Tensor, Tensor]:
        """``(estimate, error bound)``: ``A = Σ_rows D S²``; with a centre ``− 2 Σ_rows (D a)·S
        + Σ D a²``, where ``|B| ≤ √(A·C)`` again (the rows of one example are distinct)."""
        example, token, summed = self._group()
        dim, length = self.module.embedding_dim, self.ids.shape[1]
        u = _transform.unit_roundoff(self.dtype)
        sq_rows = summed * summed
        sq_rows = (sq_rows * d).sum(1) if scalar else (sq_rows * d[token]).sum(1)
        sq = self._per_example(example, sq_rows)
        sq_margin = _margin(self.dtype, dim, length) + 4 * u
        if centre is None:
            return sq, sq_margin * sq
        if scalar:  # one number D: the used rows of the centre only, D after the sums
            lin = d * self._per_example(example, (summed * centre[token]).sum(1))
            const = d * _square_sum(centre)
        else:
            lin = self._per_example(example, (summed * (d * centre)[token]).sum(1))
            const = (d * centre * centre).sum()
        upper_sq = sq * (1.0 + sq_margin)
        magnitude = (upper_sq.sqrt() + const.sqrt()) ** 2
        margin = max(sq_margin, _margin(self.dtype, math.prod(centre.shape))) + (6 if scalar else 4) * u
        return sq - 2.0 * lin + const, margin * magnitude

    def _embedding_exact(self, centre: Tensor | None, scale: Any, rows: Tensor) -> Tensor:
        """Direct bounds for units ``rows``: ``Σ_{v ∈ rows_i} D(S − a)² + Σ_{v ∉ rows_i} D a²``.

        Both sums have non-negative terms (no cancellation); the second is a masked sum of the
        per-vocabulary-row ``Σ_j D a²``, so nothing of size ``vocabulary × dim`` is formed per unit.
        """
        example, token, summed = self._group()
        d = 1.0 / (scale * scale)
        num, dim = self.module.num_embeddings, self.module.embedding_dim
        margin = _transform.rounding_margin(self.dtype, num * dim)
        scalar = _is_scalar(scale)
        if centre is None:
            per_row = (summed * summed * d).sum(1) if scalar else (summed * summed * d[token]).sum(1)
            return self._per_example(example, per_row)[rows] * (1.0 + margin)
        w = (summed - centre[token]) * ((1.0 / scale) if scalar else (1.0 / scale)[token])
        inside = self._per_example(example, (w * w).sum(1))
        mass = (d * centre * centre).sum(1)  # (vocabulary,)
        out = []
        for i in rows.tolist():
            present = torch.zeros(num, dtype=torch.bool, device=mass.device)
            present[token[example == i]] = True
            out.append(inside[i] + mass[~present].sum())
        return torch.stack(out) * (1.0 + margin) if out else inside.new_zeros(0)


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
            if name != "weight" or _kind(m) not in ("linear", "embedding") or (hooked is not None and m not in hooked):
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


class TiedGhost:
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

    @full_float32_precision()
    def weighted_sum(self, name: str, c: Tensor) -> Tensor:
        """``Σ_i c_i g_i``: the sum of every use's weighted sum (units with ``c_i = 0`` dropped)."""
        total: Tensor | None = None
        for layer, pname in self.parts:
            w = layer.weighted_sum(pname, c).reshape(self.shape)
            total = w if total is None else total + w
        assert total is not None
        return total

    @full_float32_precision()
    def norm(self, name: str, centre: Tensor | None, scale: Any) -> Tensor:
        """An upper bound of ``‖(g_i − centre)/scale‖²``, shape ``(n,)`` (class doc)."""
        if len(self.parts) == 1:
            layer, pname = self.parts[0]
            return layer.norm(pname, centre, scale)
        if centre is not None or not _is_scalar(scale):
            return self._exact(centre, scale, torch.arange(self.n, device=self._device()))
        d = 1.0 / (scale * scale)
        u = _transform.unit_roundoff(self.dtype)
        squares = [layer.norm(pname, None, scale) for layer, pname in self.parts]
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
        """Direct bounds for the units ``rows`` from their materialised gradients, a chunk at a time."""
        chunk = max(1, _CHUNK_ELEMENTS // max(1, math.prod(self.shape)))
        parts = []
        for s in range(0, int(rows.shape[0]), chunk):
            g = self.materialise("weight", rows[s : s + chunk])
            parts.append(_transform.transformed_sq_norms([g], None if centre is None else [centre], [scale])[0])
        return torch.cat(parts) if parts else torch.zeros(0, dtype=self.dtype, device=self._device())

    def _cross(self, a: GhostLayer, b: GhostLayer) -> tuple[Tensor, Tensor]:
        """``(⟨g^{(a)}_i, g^{(b)}_i⟩, a bound on its rounding error)`` per example, unscaled."""
        u = _transform.unit_roundoff(self.dtype)
        if a.kind == "linear" and b.kind == "embedding":
            a, b = b, a
        if a.kind == "embedding" and b.kind == "embedding":
            ea, eb = a.e * a._keep().reshape(a.e.shape[:2])[..., None], b.e * b._keep().reshape(b.e.shape[:2])[..., None]
            same = (a.ids[:, :, None] == b.ids[:, None, :]).to(self.dtype)
            dots = torch.bmm(ea, eb.transpose(1, 2))
            value = (same * dots).sum(dim=(1, 2))
            magnitude = (same * (ea.norm(dim=2)[:, :, None] * eb.norm(dim=2)[:, None, :])).sum(dim=(1, 2))
            return value, (_margin(self.dtype, ea.shape[2], same.shape[1] * same.shape[2]) + 4 * u) * magnitude
        if a.kind == "embedding":  # b linear: weight (V, d) = (out, in)
            delta = a.e * a._keep().reshape(a.e.shape[:2])[..., None]  # (n, L, d)
            n, length = a.ids.shape
            positions = b.x.shape[1]
            picked = b.e.gather(2, a.ids[:, None, :].expand(n, positions, length))  # (n, T, L): e_{s, t_l}
            dots = torch.bmm(b.x, delta.transpose(1, 2))  # (n, T, L): x_s · δ_l
            value = (picked * dots).sum(dim=(1, 2))
            norms = b.x.norm(dim=2)[:, :, None] * delta.norm(dim=2)[:, None, :]
            magnitude = (picked.abs() * norms).sum(dim=(1, 2))
            return value, (_margin(self.dtype, delta.shape[2], positions * length) + 4 * u) * magnitude
        # linear × linear
        gram_e = torch.bmm(a.e, b.e.transpose(1, 2))
        gram_x = torch.bmm(a.x, b.x.transpose(1, 2))
        value = (gram_e * gram_x).sum(dim=(1, 2))
        magnitude = (a.x.norm(dim=2) * a.e.norm(dim=2)).sum(dim=1) * (b.x.norm(dim=2) * b.e.norm(dim=2)).sum(dim=1)
        margin = _margin(self.dtype, a.e.shape[2], a.x.shape[2], gram_e.shape[1] * gram_e.shape[2]) + 4 * u
        return value, margin * magnitude
