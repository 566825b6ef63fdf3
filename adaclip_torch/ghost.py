"""Ghost norms: clip without storing per-example gradients of ``nn.Linear`` / ``nn.Embedding``.

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
  ``D‖e_i‖²‖x_i‖²``) and ``Σ (Da) g_i = e_iᵀ (Da) x_i`` for any T (sum over t). For T > 1 and
  scalar D: ``Σ g_i² = Σ_{t,s} (x_t·x_s)(e_t·e_s)`` (Gram matrices, cost ~T²(in+out)); for
  T > 1 with a per-coordinate D (AdaCliP) no cheaper formula exists, so the layer's per-example
  gradients are formed *transiently*, a chunk of the batch at a time, and dropped after the
  norm. ``Σ_i c_i g_i = Eᵀ diag(c) X`` (one matrix product). The bias (``g_i = Σ_t e_{it}``,
  (n, out)) is small and handled as a materialised tensor.
* ``nn.Embedding`` weight, token ids ``t_{il}``, output gradients ``e_{il}``: row v of ``g_i`` is
  ``Σ_{l: t_{il}=v} e_{il}`` (zero at ``padding_idx``). The distinct (example, token) pairs are
  grouped once (``torch.unique``), their summed rows ``S`` give
  ``Σ D g_i² = Σ_rows D[v] S²`` and ``Σ (Da) g_i = Σ_rows (Da)[v] S``; the clipped sum is an
  ``index_add`` of ``c_i e_{il}`` into row ``t_{il}``.

Calls of one module several times in a forward pass (an unrolled RNN cell) are concatenated
along the position axis (their contributions add up per example, exactly like positions). A
parameter shared by several modules (tied weights) is *not* eligible: its per-example gradient
is a sum over modules whose cross terms the formulas above do not cover; it keeps the
materialised path. Everything is computed in the statistics dtype (float32 at least) and the
norms are clamped at 0 (the expansion subtracts nearly equal numbers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from adaclip.errors import InvalidGradientError

from .grad_sample.embedding import embedding_grad_sample
from .grad_sample.linear import linear_grad_sample
from .grad_sample.registry import get_grad_sampler

__all__ = ["PER_SAMPLE_MODES", "ghost_modules", "GhostLayer"]

PER_SAMPLE_MODES = ("materialise", "ghost", "auto")
Tensor = torch.Tensor
# elements of one transient chunk of per-example gradients (AdaCliP on sequence Linear layers)
_CHUNK_ELEMENTS = 1 << 22


def _kind(module: nn.Module) -> str | None:
    rule = get_grad_sampler(module)
    if rule is None:
        return None
    if rule.fn is linear_grad_sample and isinstance(module, nn.Linear):
        return "linear"
    if rule.fn is embedding_grad_sample and isinstance(module, nn.Embedding):
        return "embedding"
    return None


def ghost_modules(model: nn.Module, params: Sequence[Tensor]) -> dict[nn.Module, str]:
    """Modules of ``model`` whose parameters can take the ghost path: ``nn.Linear`` /
    ``nn.Embedding`` (with their built-in rule) whose every parameter belongs to no other module
    (no tied weights) and whose trainable parameters are all in ``params``."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    wanted = {id(p) for p in params}
    out: dict[nn.Module, str] = {}
    for m in model.modules():
        kind = _kind(m)
        if kind is None:
            continue
        own = [p for p in m._parameters.values() if p is not None]
        if any(owners[id(p)] > 1 for p in own):
            continue
        trainable = [p for p in own if p.requires_grad]
        if not trainable or any(id(p) not in wanted for p in trainable):
            continue
        out[m] = kind
    return out


def _check_finite(t: Tensor, what: str) -> None:
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        raise InvalidGradientError(f"{what} contains NaN or inf")


class GhostLayer:
    """The captured calls of one ghost module in one (accumulated) batch.

    ``norm(name, centre, scale)`` gives the ``(n,)`` squared transformed norms of parameter
    ``name``; ``weighted_sum(name, c)`` gives ``Σ_i c_i g_i``; ``materialise(name)`` the
    ``(n, *shape)`` per-example gradients (used only where the ghost path does not apply, e.g.
    grouping by user).
    """

    def __init__(self, module: nn.Module, kind: str, captures: list[tuple[Tensor, Tensor]], dtype: torch.dtype, mode: str):
        self.module = module
        self.kind = kind
        self.mode = mode
        self.dtype = dtype
        n = int(captures[0][1].shape[0])
        if kind == "linear":
            xs, es = [], []
            for x, e in captures:
                if x.dim() < 2:
                    raise InvalidGradientError(
                        f"nn.Linear input of shape {tuple(x.shape)} has no batch dimension"
                    )
                length = math.prod(x.shape[1:-1])  # positions per example (1 without sequence dims)
                xs.append(x.reshape(n, length, module.in_features).to(dtype))
                es.append(e.reshape(n, length, module.out_features).to(dtype))
            self.x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)
            self.e = es[0] if len(es) == 1 else torch.cat(es, dim=1)
            _check_finite(self.x, f"input of {type(module).__name__}")
            _check_finite(self.e, f"output gradient of {type(module).__name__}")
        else:
            ids = [t.reshape(n, math.prod(t.shape[1:])).long() for t, _ in captures]
            es = [e.reshape(n, math.prod(t.shape[1:]), module.embedding_dim).to(dtype) for t, e in captures]
            self.ids = ids[0] if len(ids) == 1 else torch.cat(ids, dim=1)
            self.e = es[0] if len(es) == 1 else torch.cat(es, dim=1)
            _check_finite(self.e, f"output gradient of {type(module).__name__}")
            self._groups: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self.n = n
        self._bias: Tensor | None = None

    # ------------------------------------------------------------------ shared
    def materialise(self, name: str) -> Tensor:
        if self.kind == "linear":
            if name == "bias":
                return self.bias_samples()
            return torch.bmm(self.e.transpose(1, 2), self.x)
        return embedding_grad_sample(self.module, (self.ids,), self.e)["weight"].to(self.dtype)

    def bias_samples(self) -> Tensor:
        if self._bias is None:
            self._bias = self.e.sum(dim=1)
        return self._bias

    def norm(self, name: str, centre: Tensor | None, scale: Any) -> Tensor:
        """``‖(g_i − centre)/scale‖²``, shape ``(n,)``."""
        if self.kind == "linear" and name == "bias":
            w = self.bias_samples() if centre is None else self.bias_samples() - centre
            w = w / scale
            return (w * w).sum(dim=1)
        scalar = not isinstance(scale, Tensor)
        d = 1.0 / (scale * scale)
        if self.kind == "linear":
            sq = self._linear_sq(d, scalar)
            lin = None if centre is None else ((self.e @ (d * centre)) * self.x).sum(dim=(1, 2))
        else:
            sq, lin = self._embedding_terms(d, None if centre is None else d * centre, scalar)
        out = sq if lin is None else sq - 2.0 * lin
        if centre is not None:
            out = out + (d * centre * centre).sum()
        return out.clamp_min(0.0)

    def weighted_sum(self, name: str, c: Tensor) -> Tensor:
        """``Σ_i c_i g_i`` shaped like the parameter."""
        c = c.to(self.dtype)
        if self.kind == "linear":
            if name == "bias":
                return c @ self.bias_samples()
            ce = self.e * c[:, None, None]
            return ce.reshape(-1, self.module.out_features).T @ self.x.reshape(-1, self.module.in_features)
        num, dim = self.module.num_embeddings, self.module.embedding_dim
        keep = self._keep()
        rows = self.ids.reshape(-1)[keep]
        vals = (self.e * c[:, None, None]).reshape(-1, dim)[keep]
        return torch.zeros(num, dim, dtype=self.dtype, device=self.e.device).index_add_(0, rows, vals)

    # ------------------------------------------------------------------ Linear
    def _linear_sq(self, d: Any, scalar: bool) -> Tensor:
        """``Σ D g_i²`` per example."""
        x, e = self.x, self.e
        n, t = x.shape[0], x.shape[1]
        in_f, out_f = x.shape[2], e.shape[2]
        if t == 1:
            x2, e2 = x[:, 0] ** 2, e[:, 0] ** 2
            if scalar:
                return d * x2.sum(1) * e2.sum(1)
            return ((e2 @ d) * x2).sum(1)
        if scalar and (self.mode == "ghost" or t * (in_f + out_f) <= in_f * out_f):
            gram_x = torch.bmm(x, x.transpose(1, 2))
            gram_e = torch.bmm(e, e.transpose(1, 2))
            return d * (gram_x * gram_e).sum(dim=(1, 2))
        # transient: this layer's per-example gradients, a chunk of the batch at a time
        chunk = max(1, _CHUNK_ELEMENTS // max(1, in_f * out_f))
        parts = []
        for s in range(0, n, chunk):
            g = torch.bmm(e[s : s + chunk].transpose(1, 2), x[s : s + chunk])
            parts.append((g * g * d).sum(dim=(1, 2)))
        return torch.cat(parts) if parts else x.new_zeros(0)

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

    def _embedding_terms(self, d: Any, dm: Tensor | None, scalar: bool) -> tuple[Tensor, Tensor | None]:
        example, token, summed = self._group()
        sq_rows = summed * summed
        sq_rows = (sq_rows * d).sum(1) if scalar else (sq_rows * d[token]).sum(1)
        sq = torch.zeros(self.n, dtype=self.dtype, device=self.e.device).index_add_(0, example, sq_rows)
        if dm is None:
            return sq, None
        lin_rows = (summed * dm[token]).sum(1)
        lin = torch.zeros(self.n, dtype=self.dtype, device=self.e.device).index_add_(0, example, lin_rows)
        return sq, lin
