"""Per-sample gradients of ``nn.Linear``.

For y = x Wᵀ + b with x of shape (n, *, in) (``*``: any number of sequence dims, flattened to
one of length L), example i's gradients are sums over its own positions l:

    ∂L_i/∂W = Σ_l  δ_{i,l} x_{i,l}ᵀ   (shape (out, in)),      ∂L_i/∂b = Σ_l δ_{i,l},

with δ = ∂L/∂y. One batched matrix product computes all n at once.

The ghost form (:class:`LinearGhost`) computes the norms and the clipped sum of these gradients
from ``x`` and ``δ`` without forming them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from adaclip import transform as _transform
from adaclip.errors import InvalidGradientError

from . import ghost_layer as _ghost_layer
from .ghost_layer import GhostLayer, direct_norms, margin, square_sum
from .registry import register_grad_sampler

__all__ = ["linear_grad_sample", "LinearGhost", "rank_one", "RANK_ONE_ROUNDINGS"]

Tensor = torch.Tensor

def linear_grad_sample(
    module: nn.Linear, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    x = activations[0]
    if x.dim() < 2:
        raise InvalidGradientError(
            f"nn.Linear input of shape {tuple(x.shape)} has no batch dimension; "
            "per-sample gradients need a batched input (n, ..., in_features)"
        )
    n = x.shape[0]
    length = math.prod(x.shape[1:-1])  # positions per example (1 without sequence dims)
    a = x.reshape(n, length, module.in_features)
    d = backprops.reshape(n, length, module.out_features)
    out: dict[str, torch.Tensor] = {}
    if module.weight.requires_grad:
        out["weight"] = torch.bmm(d.transpose(1, 2), a)
    if module.bias is not None and module.bias.requires_grad:
        out["bias"] = d.sum(dim=1)
    return out


# ---------------------------------------------------------------------------------- ghost norms
#: How far (relative, in units of the dtype's unit roundoff) ``D = 1/b²`` may exceed its rank-one
#: factorisation for a sequence ``nn.Linear`` to take the Gram form (:func:`rank_one`). The
#: factored pooling's scale is rank one up to a few roundings; a clamp that bites breaks it.
RANK_ONE_ROUNDINGS = 256


def rank_one(d: Tensor) -> tuple[Tensor, Tensor, float] | None:
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


class LinearGhost(GhostLayer):
    """Ghost norms of ``nn.Linear``: input ``x_i`` (T positions × in), output gradient ``e_i``
    (T × out), ``g_i = Σ_t e_{it} x_{it}ᵀ``.

    For T = 1: ``Σ D g_i² = (e_i²)ᵀ D (x_i²)`` (with scalar D: ``D‖e_i‖²‖x_i‖²``; with
    ``D = u vᵀ`` of rank one: ``(e_i²·u)(x_i²·v)``, as cheap as the scalar case) and
    ``Σ (Da) g_i = e_iᵀ (Da) x_i`` for any T (sum over t). For T > 1 and scalar D:
    ``Σ g_i² = Σ_{t,s} (x_t·x_s)(e_t·e_s)`` (Gram matrices, cost ~T²(in+out)); the same on
    rescaled outputs and inputs when ``D = u vᵀ`` has rank one. For T > 1 with a general
    per-coordinate D (AdaCliP's coordinate pooling) no cheaper formula exists, so the layer's
    per-example gradients are formed *transiently*, a chunk of the batch at a time, and dropped
    after the norm. ``Σ_i c_i g_i = Eᵀ diag(c) X`` (one matrix product; ``diag(c)`` applied to
    the narrower of ``E`` and ``X``). Under ``loss_reduction="mean"`` the captured ``e`` is the
    mean loss's, ``1/n`` of example i's own: the forms run on it as captured and multiply their
    per-example results by ``s = n`` (norms by ``s²``, the cross term by ``s``, the clip factors
    by ``s`` rounded toward zero), with the extra roundings in the error bound. The bias
    (``g_i = Σ_t e_{it}``, (n, out)) is small and normed as a materialised tensor.

    Subclasses reuse these forms for layers that are a Linear layer in disguise
    (:class:`~adaclip_torch.grad_sample.conv.ConvGhost` on unfolded patches,
    :class:`~adaclip_torch.grad_sample.hf.Conv1DGhost` on the transposed weight): they
    override :meth:`_capture` and the layout maps :meth:`_as_matrix`, :meth:`_weight_out`,
    :meth:`_samples_out`.
    """

    kind = "linear"
    small_names = frozenset({"bias"})

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear)

    def _features(self) -> tuple[int, int]:
        """``(in, out)`` of the weight seen as an ``(out, in)`` matrix."""
        return self.module.in_features, self.module.out_features

    def _capture(self, captures: list[tuple[Tensor, Tensor]]) -> None:
        in_f, out_f = self._features()
        n, dtype = self.n, self.dtype
        xs, es = [], []
        for x, e in captures:
            if x.dim() < 2:
                raise InvalidGradientError(
                    f"{type(self.module).__name__} input of shape {tuple(x.shape)} has no batch dimension"
                )
            length = math.prod(x.shape[1:-1])  # positions per example (1 without sequence dims)
            xs.append(x.reshape(n, length, in_f).to(dtype))
            es.append(e.reshape(n, length, out_f).to(dtype))
        self._set_positions(xs, es)
        self.in_f, self.out_f = int(in_f), int(out_f)

    def _set_positions(self, xs: list[Tensor], es: list[Tensor]) -> None:
        """Several calls of the module are concatenated along the position axis."""
        self.x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)
        self.e = es[0] if len(es) == 1 else torch.cat(es, dim=1)

    # layout maps: the weight as the (out, in) matrix of the forms, and back
    def _weight_out(self, w: Tensor) -> Tensor:
        """An ``(out, in)`` matrix in the parameter's layout."""
        return w

    def _samples_out(self, g: Tensor) -> Tensor:
        """``(n, out, in)`` per-example matrices in the parameter's layout."""
        return g

    def _materialise(self, name: str, rows: Tensor | None) -> Tensor:
        return self._samples_out(self._weight_samples(rows))

    def _weight_samples(self, rows: Tensor | None = None) -> Tensor:
        """``(n, out, in)`` per-example weight gradients ``s·e_iᵀ x_i``."""
        e, x = (self.e, self.x) if rows is None else (self.e[rows], self.x[rows])
        g = torch.bmm(e.transpose(1, 2), x)
        return g if self.loss_scale == 1.0 else g.mul_(self.loss_scale)

    def _small_samples(self, name: str) -> Tensor:
        b = self.e.sum(dim=1)  # the bias, the one small parameter: s·Σ_t e_{it}
        return b if self.loss_scale == 1.0 else b.mul_(self.loss_scale)

    def _exact_rows(self, name: str, centre: Tensor | None, scale: Any, rows: Tensor) -> Tensor:
        """Direct bounds of the weight's norms for the units ``rows``, from their materialised
        gradients, a chunk of units at a time (centre and scale as matrices)."""
        chunk = max(1, _ghost_layer.CHUNK_ELEMENTS // max(1, self.in_f * self.out_f))
        parts = [direct_norms(self._weight_samples(rows[s : s + chunk]), centre, scale)
                 for s in range(0, int(rows.shape[0]), chunk)]  # fmt: skip
        if not parts:
            return torch.zeros(0, dtype=self.dtype, device=self.e.device)
        out = torch.cat(parts)
        return out if self.loss_scale == 1.0 else out * self._scale_bound()

    def _weighted_sum(self, name: str, cs: Tensor, keep: Tensor, dropped: bool) -> Tensor:
        e, x = self.e, self.x
        if dropped:
            e = torch.where(keep[:, None, None], e, 0.0)
            x = torch.where(keep[:, None, None], x, 0.0)
        # Σ_i c_i s e_iᵀ x_i: the factors (with the loss scale s folded in) go on the narrower of
        # the two, one pass over the smaller tensor
        cs = cs[:, None, None]
        if self.in_f < self.out_f:
            x = x * cs
        else:
            e = e * cs
        w = e.reshape(-1, self.out_f).T @ x.reshape(-1, self.in_f)
        return self._weight_out(w)

    def _terms(self, name: str, d: Any, centre: Tensor | None, scale: Any, scalar: bool) -> tuple[Tensor, Tensor]:
        """``(estimate, error bound)`` of the squared transformed norms of the weight.

        Sequences (T > 1) take the Gram form when ``D = 1/b²`` is a scalar or (numerically) of
        rank one, ``D ≤ κ·u vᵀ`` elementwise with ``κ − 1`` within rounding (:func:`rank_one`:
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
        u = self.unit_roundoff
        cheap = self.mode == "ghost" or t * (in_f + out_f) <= in_f * out_f
        factors = rank_one(d) if (cheap and not scalar) else None
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
            sq_margin = margin(self.dtype, in_f, out_f) + 6 * u
            sq_magnitude = sq  # non-negative terms
        elif factors is None:  # Gram form (scalar D): Σ_{t,s} (x_t·x_s)(e_t·e_s)
            gram_x = torch.bmm(x, x.transpose(1, 2))
            gram_e = torch.bmm(e, e.transpose(1, 2))
            sq = d * (gram_x * gram_e).sum(dim=(1, 2))
            sq_margin = margin(self.dtype, in_f, out_f, t * t) + 4 * u
            sq_magnitude = d * self._position_norm_sum() ** 2
        else:  # Gram form of D ≤ κ·u vᵀ on ẽ = √u ⊙ e, x̃ = √v ⊙ x (over-estimates by at most κ)
            rows, cols, kappa = factors
            xs, es = x * cols.sqrt(), e * rows.sqrt()
            gram_x = torch.bmm(xs, xs.transpose(1, 2))
            gram_e = torch.bmm(es, es.transpose(1, 2))
            sq = kappa * (gram_x * gram_e).sum(dim=(1, 2))
            # 8u more: the square roots' rounding, (√u)² = u(1 ± 2u) on each side
            sq_margin = margin(self.dtype, in_f, out_f, t * t) + 12 * u
            sq_magnitude = kappa * ((xs.norm(dim=2) * es.norm(dim=2)).sum(dim=1)) ** 2
        s = self.loss_scale
        if s != 1.0:  # the per-example gradients are s·(what was captured): A scales by s², B by s
            same = sq_magnitude is sq  # T = 1: the terms are their own magnitude; scale once
            sq = sq * (s * s)
            sq_magnitude = sq if same else sq_magnitude * (s * s)
            sq_margin += 3 * u  # s² rounded to the dtype, its product, and the magnitude's
        if centre is None:
            return sq, sq_margin * sq_magnitude
        if scalar:  # one number D: multiply the sums, not the centre (no pass over the weight)
            lin = d * ((e @ centre) * x).sum(dim=(1, 2))
            const = d * square_sum(centre)
        else:
            lin = ((e @ (d * centre)) * x).sum(dim=(1, 2))
            const = (d * centre * centre).sum()
        if s != 1.0:
            lin = lin * s
        estimate = sq - 2.0 * lin + const
        # The terms of B = Σ_t e_tᵀ(Da)x_t have absolute sum ≤ √M·√C (Cauchy–Schwarz on √D·e_t x_tᵀ
        # and √D·a, summed over t), M = sq_magnitude ≥ A (for T = 1, M = A); every term's error is
        # at most its margin times (√M + √C)², and the two additions add 2u of (A + 2|B| + C) each.
        upper_sq = sq_magnitude * (1.0 + sq_margin)
        magnitude = (upper_sq.clamp_min(0.0).sqrt() + const.sqrt()) ** 2
        total_margin = max(sq_margin, margin(self.dtype, out_f, t * in_f), margin(self.dtype, in_f * out_f)) + 4 * u
        if scalar:
            total_margin += 2 * u  # B and C multiplied by D after their sums: one rounding more each
        if s != 1.0:
            total_margin += 2 * u  # B multiplied by s (s rounded to the dtype, and the product)
        return estimate, total_margin * magnitude

    def _position_norm_sum(self) -> Tensor:
        """``Σ_t ‖x_t‖·‖e_t‖`` per example: bounds ``Σ_{t,s} |x_t·x_s||e_t·e_s|`` by its square."""
        return (self.x.norm(dim=2) * self.e.norm(dim=2)).sum(dim=1)


register_grad_sampler(nn.Linear, ghost=LinearGhost)(linear_grad_sample)
