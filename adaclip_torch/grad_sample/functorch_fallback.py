"""Per-sample gradients of any module without a rule, by :mod:`torch.func`.

For a module f with its own parameters θ (``module._parameters``, children excluded: they
have their own hooks), captured inputs x (batch n) and the captured output gradient δ = ∂L/∂y,
example i's gradient is the vector–Jacobian product of f at example i alone:

    ∂L_i/∂θ = ∂/∂θ ⟨ f(θ; x_i), δ_i ⟩,

valid because a module without cross-example coupling has y_i = f(θ; x_i), so δ_i carries all
of the loss's dependence on y_i. It is computed by re-running ``forward`` on a batch of one
(the batch axis re-inserted), under ``vmap(grad(·))`` over the n examples. Operators that have
no batching rule under vmap (``nn.LSTM``/``nn.GRU``/``nn.RNN``'s fused kernels use in-place
writes that vmap rejects) fall back to a Python loop of n small forward+backward passes —
correct but slower (use :class:`adaclip_torch.layers.DPLSTM` for speed).

Outputs may be any pytree of tensors (``nn.LSTM`` returns ``(output, (h_n, c_n))``); an output
that did not reach the loss contributes nothing (zero cotangent).

Requirements (documented, partially checked): the forward must be deterministic (it runs
again: no dropout inside the module while training) and must treat examples independently;
every tensor input and output must carry the batch at the engine's batch dimension, except for
``nn.RNNBase`` and ``nn.MultiheadAttention`` (see :func:`fallback_batch_dims`).

A module without a rule that has parameter-owning descendants is handled over its whole subtree
(its descendants are then not hooked): ``nn.MultiheadAttention`` reads its ``out_proj`` child's
weights without calling it, so only the parent sees that use.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from adaclip.errors import InvalidGradientError

from ._state import mute_hooks

__all__ = ["fallback_batch_dims", "fallback_free_grad_sample", "fallback_grad_sample"]

# Modules whose forward failed under vmap once: go straight to the loop next time.
_VMAP_UNSUPPORTED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


_UNBATCHED = -1
_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def _dims_tree(tree: Any, dim: int) -> Any:
    return tree_map(lambda leaf: dim if isinstance(leaf, torch.Tensor) else _UNBATCHED, tree)


def _flat(tree: Any) -> list[int | None]:
    return [None if d == _UNBATCHED else d for d in tree_flatten(tree)[0]]


def fallback_batch_dims(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any, batch_dim: int
) -> tuple[list[int | None], list[int | None]]:
    """Batch dimension of every leaf of ``tree_flatten((args, kwargs))`` and of
    ``tree_flatten(output)`` (``None``: not batched, shared by all examples).

    - ``nn.RNNBase``: input per the module's ``batch_first``; initial states and final states
      ``(layers·dirs, n, H)`` on dim 1.
    - ``nn.MultiheadAttention``: query/key/value and the attention output per the module's
      ``batch_first``; ``key_padding_mask`` (n, S) and the attention weights (n, L, S) on dim 0;
      a 2-D ``attn_mask`` is shared (a 3-D per-example-and-head mask is rejected).
    - any other module: every tensor on the engine's batch dimension.
    """
    if isinstance(module, nn.RNNBase):
        first = 0 if module.batch_first else 1
        in_tree = (tuple(_dims_tree(a, first if k == 0 else 1) for k, a in enumerate(args)),
                   {k: _dims_tree(v, first if k == "input" else 1) for k, v in kwargs.items()})
        out = output if isinstance(output, tuple) else (output,)
        out_tree = tuple(_dims_tree(o, first if k == 0 else 1) for k, o in enumerate(out))
        return _flat(in_tree), _flat(out_tree if isinstance(output, tuple) else out_tree[0])
    if isinstance(module, nn.MultiheadAttention):
        first = 0 if module.batch_first else 1

        def mha_dim(name: str, value: Any) -> Any:
            if name in ("query", "key", "value"):
                return _dims_tree(value, first)
            if name == "key_padding_mask":
                return _dims_tree(value, 0)
            if name == "attn_mask" and isinstance(value, torch.Tensor) and value.dim() != 2:
                raise InvalidGradientError(
                    "nn.MultiheadAttention with a 3-D attn_mask (per example and head) is not supported "
                    "by the per-sample-gradient fallback; pass a 2-D mask and/or key_padding_mask"
                )
            return _dims_tree(value, _UNBATCHED)

        in_tree = (tuple(mha_dim(_MHA_ARGS[k] if k < len(_MHA_ARGS) else "", a) for k, a in enumerate(args)),
                   {k: mha_dim(k, v) for k, v in kwargs.items()})
        out_tree = (_dims_tree(output[0], first), _dims_tree(output[1], 0))
        return _flat(in_tree), _flat(out_tree)
    return _flat(_dims_tree((args, kwargs), batch_dim)), _flat(_dims_tree(output, batch_dim))


def _check_batch(
    module: nn.Module, leaves: Sequence[Any], dims: Sequence[int | None], what: str, path: str | None = None
) -> int | None:
    where = f"{type(module).__name__} `{path}`" if path else type(module).__name__
    n: int | None = None
    for leaf, d in zip(leaves, dims):
        if d is None:
            continue
        if leaf.dim() <= d:
            raise InvalidGradientError(
                f"{where}: {what} of shape {tuple(leaf.shape)} has no batch dim {d}; "
                "the torch.func fallback needs every tensor input/output batched"
            )
        if n is None:
            n = leaf.shape[d]
        elif leaf.shape[d] != n:
            hint = ""
            if path:
                hint = (
                    ". If the module's output does not depend on the batch (position embeddings computed "
                    "from the input's shape, as BART's decoder does), declare it: "
                    f"adaclip_torch.grad_sample.mark_batch_free(model.{path}); or pass it batched inputs, or "
                    f"freeze it (model.{path}.requires_grad_(False))"
                )
            raise InvalidGradientError(
                f"{where}: {what} of shape {tuple(leaf.shape)} has {leaf.shape[d]} "
                f"on batch dim {d}, other tensors have {n}; the torch.func fallback assumes every "
                f"tensor input/output is batched on the same dimension{hint}"
            )
    return n


def fallback_grad_sample(
    module: nn.Module,
    param_names: Sequence[str],
    in_leaves: list[Any],
    in_spec: TreeSpec,
    in_dims: list[int | None],
    out_grads: list[tuple[int, torch.Tensor, int]],
    n: int,
) -> dict[str, torch.Tensor]:
    """Per-example gradients of ``module``'s parameters ``param_names`` (dotted names for
    parameters of descendants, which the fallback then covers too).

    ``in_leaves``/``in_spec``: the flattened ``(args, kwargs)`` of the call (tensors detached);
    ``in_dims``: their batch dims; ``out_grads``: ``(output leaf index, gradient, batch dim)``
    for every output that received a gradient (already scaled for the loss reduction).
    Returns ``{name: (n, *param.shape)}``.
    """
    params = {k: module.get_parameter(k).detach() for k in param_names}
    if n == 0:
        return {k: p.new_zeros((0, *p.shape)) for k, p in params.items()}
    if module not in _VMAP_UNSUPPORTED and not isinstance(module, nn.RNNBase):
        try:
            return _vmap_path(module, params, in_leaves, in_spec, in_dims, out_grads)
        except (RuntimeError, NotImplementedError):
            _VMAP_UNSUPPORTED.add(module)
    return _loop_path(module, params, in_leaves, in_spec, in_dims, out_grads, n)


def _vmap_path(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    in_leaves: list[Any],
    in_spec: TreeSpec,
    in_dims: list[int | None],
    out_grads: list[tuple[int, torch.Tensor, int]],
) -> dict[str, torch.Tensor]:
    batched_idx = [k for k, d in enumerate(in_dims) if d is not None]
    batched = [in_leaves[k] for k in batched_idx]
    grads = [g for _, g, _ in out_grads]

    def inner(p: dict[str, torch.Tensor], xs: list[torch.Tensor], gs: list[torch.Tensor]) -> torch.Tensor:
        leaves = list(in_leaves)
        for k, x in zip(batched_idx, xs):
            leaves[k] = x.unsqueeze(in_dims[k])
        args, kwargs = tree_unflatten(leaves, in_spec)
        out_leaves, _ = tree_flatten(functional_call(module, p, tuple(args), kwargs))
        total = torch.zeros((), dtype=gs[0].dtype, device=gs[0].device) if gs else None
        for (idx, _, d), g in zip(out_grads, gs):
            total = total + (out_leaves[idx] * g.unsqueeze(d)).sum()
        return total

    x_dims = [in_dims[k] for k in batched_idx]
    g_dims = [d for _, _, d in out_grads]
    with mute_hooks(), warnings.catch_warnings():
        # torch warns when an op has no batching rule and vmap loops internally; still correct
        warnings.filterwarnings("ignore", message="There is a performance drop")
        return vmap(grad(inner), in_dims=(None, x_dims, g_dims))(params, batched, grads)


def _loop_path(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    in_leaves: list[Any],
    in_spec: TreeSpec,
    in_dims: list[int | None],
    out_grads: list[tuple[int, torch.Tensor, int]],
    n: int,
) -> dict[str, torch.Tensor]:
    names = list(params)
    per_example: list[list[torch.Tensor]] = []
    with mute_hooks(), torch.enable_grad():
        for i in range(n):
            leaves = [
                leaf.narrow(d, i, 1) if d is not None else leaf for leaf, d in zip(in_leaves, in_dims)
            ]
            args, kwargs = tree_unflatten(leaves, in_spec)
            p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
            out_leaves, _ = tree_flatten(functional_call(module, p, tuple(args), kwargs))
            outs = [out_leaves[idx] for idx, _, _ in out_grads]
            cots = [g.narrow(d, i, 1) for _, g, d in out_grads]
            got = torch.autograd.grad(outs, [p[k] for k in names], cots, allow_unused=True)
            per_example.append([torch.zeros_like(p[k]) if g is None else g for k, g in zip(names, got)])
    return {k: torch.stack([ex[j] for ex in per_example]) for j, k in enumerate(names)}


def fallback_free_grad_sample(
    module: nn.Module,
    param_names: Sequence[str],
    in_leaves: list[Any],
    in_spec: TreeSpec,
    out_grads: list[tuple[int, torch.Tensor]],
    n: int,
) -> dict[str, torch.Tensor]:
    """Per-example gradients of ``module``'s parameters for a *batch-free* call (inputs the same
    for every example, :mod:`adaclip_torch.grad_sample.batch_free`): with ``δ_i`` example i's
    gradient of output leaf k (``out_grads``: ``(k, (n, *leaf.shape))``),

        ∂ℓ_i/∂θ = J_f(θ; u)ᵀ δ_i,

    one vector–Jacobian product of the call (run once, on the inputs ``u`` as they were),
    applied to the n cotangents under vmap (a loop where vmap cannot run).
    """
    params = {k: module.get_parameter(k).detach() for k in param_names}
    if n == 0:
        return {k: p.new_zeros((0, *p.shape)) for k, p in params.items()}
    idxs = [k for k, _ in out_grads]
    cots = tuple(g for _, g in out_grads)

    def call(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        args, kwargs = tree_unflatten(list(in_leaves), in_spec)
        out_leaves, _ = tree_flatten(functional_call(module, p, tuple(args), kwargs))
        return tuple(out_leaves[k] for k in idxs)

    with mute_hooks():
        _, vjp_fn = torch.func.vjp(call, params)
        try:
            return vmap(vjp_fn)(cots)[0]
        except (RuntimeError, NotImplementedError):
            rows = [vjp_fn(tuple(c[i] for c in cots))[0] for i in range(n)]
            return {k: torch.stack([r[k] for r in rows]) for k in params}
