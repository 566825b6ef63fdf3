"""Per-sample gradients of ``nn.Embedding``.

With token ids t (shape (n, *)) and δ = ∂L/∂y (shape (n, *, D)), row v of example i's weight
gradient is the sum of δ over the positions where example i used token v:

    ∂L_i/∂W[v] = Σ_{l : t_{i,l} = v} δ_{i,l},

and the ``padding_idx`` row (if any) gets zero, as in torch's own backward. Computed with one
``index_add_`` into an (n·V, D) buffer, example i's tokens offset by i·V.

``scale_grad_by_freq=True`` scales by frequencies counted over the whole mini-batch, which
couples the examples; it is rejected when the hooks are attached.

Ghost form (:class:`EmbeddingGhost`): the distinct (example, token) pairs are grouped once
(``torch.unique``), their summed rows ``S`` give ``Σ D g_i² = Σ_rows D[v] S²`` and
``Σ (Da) g_i = Σ_rows (Da)[v] S``; the clipped sum is an ``index_add`` of ``c_i δ_{il}`` into row
``t_{il}``. Nothing of size ``n × V × D`` is formed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from adaclip import transform as _transform

from .ghost_layer import GhostLayer, is_scalar, margin, square_sum
from .registry import register_grad_sampler

__all__ = ["embedding_grad_sample", "EmbeddingGhost"]

Tensor = torch.Tensor


def embedding_grad_sample(
    module: nn.Embedding, activations: tuple[torch.Tensor, ...], backprops: torch.Tensor
) -> dict[str, torch.Tensor]:
    if not module.weight.requires_grad:
        return {}
    ids = activations[0]
    n = ids.shape[0]
    num, dim = module.num_embeddings, module.embedding_dim
    flat_ids = ids.reshape(n, math.prod(ids.shape[1:])).long()
    offsets = torch.arange(n, device=ids.device).unsqueeze(1) * num
    rows = (flat_ids + offsets).reshape(-1)
    values = backprops.reshape(-1, dim).to(module.weight.dtype)
    gs = torch.zeros(n * num, dim, dtype=module.weight.dtype, device=module.weight.device)
    gs.index_add_(0, rows, values)
    gs = gs.view(n, num, dim)
    if module.padding_idx is not None:
        gs[:, module.padding_idx] = 0
    return {"weight": gs}


class EmbeddingGhost(GhostLayer):
    """Ghost norms of ``nn.Embedding``'s weight: token ids ``t_{il}``, output gradients ``e_{il}``;
    row v of ``g_i`` is ``Σ_{l: t_{il}=v} e_{il}`` (zero at ``padding_idx``). Module doc for the
    forms."""

    kind = "embedding"

    @classmethod
    def applies(cls, module: nn.Module) -> bool:
        return isinstance(module, nn.Embedding)

    def _capture(self, captures: list[tuple[Tensor, Tensor]]) -> None:
        n, dim = self.n, self.module.embedding_dim
        ids = [t.reshape(n, math.prod(t.shape[1:])).long() for t, _ in captures]
        es = [e.reshape(n, math.prod(t.shape[1:]), dim).to(self.dtype) for t, e in captures]
        self.ids = ids[0] if len(ids) == 1 else torch.cat(ids, dim=1)
        self.e = es[0] if len(es) == 1 else torch.cat(es, dim=1)

    def _materialise(self, name: str, rows: Tensor | None) -> Tensor:
        ids, e = (self.ids, self.e) if rows is None else (self.ids[rows], self.e[rows])
        if self.loss_scale != 1.0:
            e = e * self.loss_scale
        return embedding_grad_sample(self.module, (ids,), e)["weight"].to(self.dtype)

    def _weighted_sum(self, name: str, cs: Tensor, keep: Tensor, dropped: bool) -> Tensor:
        num, dim = self.module.num_embeddings, self.module.embedding_dim
        e = torch.where(keep[:, None, None], self.e, 0.0) if dropped else self.e
        mask = self._keep()
        rows = self.ids.reshape(-1)[mask]
        vals = (e * cs[:, None, None]).reshape(-1, dim)[mask]
        return torch.zeros(num, dim, dtype=self.dtype, device=self.e.device).index_add_(0, rows, vals)

    def _keep(self) -> Tensor:
        """Positions whose token is not ``padding_idx`` (their gradient is 0)."""
        flat = self.ids.reshape(-1)
        pad = self.module.padding_idx
        return torch.ones_like(flat, dtype=torch.bool) if pad is None else flat != pad

    def _group(self) -> tuple[Tensor, Tensor, Tensor]:
        """Distinct (example, token) pairs: (example of each pair, token of each pair, summed rows
        ``S``, each output gradient scaled by the loss scale ``s`` as it is added: one rounding)."""
        num, dim = self.module.num_embeddings, self.module.embedding_dim
        n, length = self.ids.shape
        example = torch.arange(n, device=self.ids.device).repeat_interleave(length)
        keep = self._keep()
        keys = (example * num + self.ids.reshape(-1))[keep]
        uniq, inverse = torch.unique(keys, return_inverse=True)
        summed = torch.zeros(uniq.shape[0], dim, dtype=self.dtype, device=self.e.device)
        summed.index_add_(0, inverse, self.e.reshape(-1, dim)[keep], alpha=self.loss_scale)
        return uniq // num, uniq % num, summed

    def _per_example(self, example: Tensor, rows: Tensor) -> Tensor:
        return torch.zeros(self.n, dtype=self.dtype, device=self.e.device).index_add_(0, example, rows)

    def _terms(self, name: str, d: Any, centre: Tensor | None, scale: Any, scalar: bool) -> tuple[Tensor, Tensor]:
        """``(estimate, error bound)``: ``A = Σ_rows D S²``; with a centre ``− 2 Σ_rows (D a)·S
        + Σ D a²``, where ``|B| ≤ √(A·C)`` again (the rows of one example are distinct)."""
        example, token, summed = self._group()
        dim, length = self.module.embedding_dim, self.ids.shape[1]
        u = self.unit_roundoff
        sq_rows = summed * summed
        sq_rows = (sq_rows * d).sum(1) if scalar else (sq_rows * d[token]).sum(1)
        sq = self._per_example(example, sq_rows)
        sq_margin = margin(self.dtype, dim, length) + 4 * u
        if self.loss_scale != 1.0:
            sq_margin += 3 * u  # each output gradient times s as it is summed: (1 + u)² on a square
        if centre is None:
            return sq, sq_margin * sq
        if scalar:  # one number D: the used rows of the centre only, D after the sums
            lin = d * self._per_example(example, (summed * centre[token]).sum(1))
            const = d * square_sum(centre)
        else:
            lin = self._per_example(example, (summed * (d * centre)[token]).sum(1))
            const = (d * centre * centre).sum()
        upper_sq = sq * (1.0 + sq_margin)
        magnitude = (upper_sq.sqrt() + const.sqrt()) ** 2
        total_margin = max(sq_margin, margin(self.dtype, math.prod(centre.shape))) + (6 if scalar else 4) * u
        return sq - 2.0 * lin + const, total_margin * magnitude

    def _exact_rows(self, name: str, centre: Tensor | None, scale: Any, rows: Tensor) -> Tensor:
        """Direct bounds for units ``rows``: ``Σ_{v ∈ rows_i} D(S − a)² + Σ_{v ∉ rows_i} D a²``.

        Both sums have non-negative terms (no cancellation); the second is a masked sum of the
        per-vocabulary-row ``Σ_j D a²``, so nothing of size ``vocabulary × dim`` is formed per unit.
        """
        example, token, summed = self._group()
        d = 1.0 / (scale * scale)
        num, dim = self.module.num_embeddings, self.module.embedding_dim
        total_margin = _transform.rounding_margin(self.dtype, num * dim)
        if self.loss_scale != 1.0:
            total_margin += 3 * self.unit_roundoff  # S holds s·δ, rounded (see _terms)
        scalar = is_scalar(scale)
        if centre is None:
            per_row = (summed * summed * d).sum(1) if scalar else (summed * summed * d[token]).sum(1)
            return self._per_example(example, per_row)[rows] * (1.0 + total_margin)
        w = (summed - centre[token]) * ((1.0 / scale) if scalar else (1.0 / scale)[token])
        inside = self._per_example(example, (w * w).sum(1))
        mass = (d * centre * centre).sum(1)  # (vocabulary,)
        out = []
        for i in rows.tolist():
            present = torch.zeros(num, dtype=torch.bool, device=mass.device)
            present[token[example == i]] = True
            out.append(inside[i] + mass[~present].sum())
        return torch.stack(out) * (1.0 + total_margin) if out else inside.new_zeros(0)


register_grad_sampler(nn.Embedding, ghost=EmbeddingGhost)(embedding_grad_sample)
