"""Module calls whose input does not carry the batch ("batch-free" calls): per-example gradients through a broadcast.

The maths. A module ``f`` with parameters θ is sometimes called on an input ``u`` that is the
same for every example — position ids of shape ``(1, L)`` (GPT-2, BERT), a relative-position
bucket matrix ``(L, L)`` without any batch dim (T5), a learned constant — and its output
``o = f(θ; u)`` is combined with the batch later, by broadcasting: ``h_i = φ(a_i, o)`` for every
example ``i`` (``h = a + o`` with ``a`` of shape ``(n, L, D)`` and ``o`` of shape ``(1, L, D)``).
With ``L = Σ_i ℓ_i(h_i)``, autograd hands ``o`` only the batch-reduced gradient
``∂L/∂o = Σ_i ∂ℓ_i/∂o``, from which example i's share cannot be recovered. But example i's own
loss depends on θ only through *its own copy* of ``o``, so

.. math::
    ∂ℓ_i/∂θ = J_f(θ; u)^T δ_i, \\qquad δ_i = ∂ℓ_i/∂o = (∂h_i/∂o)^T\\,∂ℓ_i/∂h_i,

the example's own output gradient routed through the shared input: the layer's usual rule
applied to ``u`` (the same for every i) and the cotangent ``δ_i``. For ``nn.Embedding`` with ids
``t`` of shape ``(1, L)`` that is ``∂ℓ_i/∂W[v] = Σ_{l: t_{0,l} = v} δ_{i,l}`` — grad_output[i]
scattered at ``t[0]``.

How ``δ_i`` is captured. The hooks know the batch size n of the model call (dim 0 of its tensor
inputs) and which tensors of the call descend from its batched inputs
(:mod:`adaclip_torch.grad_sample._provenance`). A *batch-free* call — a module called on an input
that does not descend from the batch, whatever its shape (an index built in ``forward``, a
buffer, a parameter), a module whose input is itself batch-free, a module without tensor inputs
(a learned constant), or a module declared with :func:`mark_batch_free` (see
:meth:`~adaclip_torch.grad_sample.GradSampleHooks._batch_free_call`) — returns its output wrapped as a :class:`BatchFreeTensor`. Operations on
such a tensor that involve no batched tensor return wrapped results too (views, permutes, the
addition of a constant mask: the *chain* from ``o``). The first operation that combines it with
a tensor of batch n — an elementwise broadcast (``+``, ``*``, ``where``, ``masked_fill``, …), an
``expand`` to the batch, or the ``attn_mask`` of ``scaled_dot_product_attention`` — runs on its
explicit expansion ``E = s.expand(result shape)`` instead: the same values, so the forward pass
is unchanged, but autograd now delivers ``∂L/∂E``, whose row i is example i's gradient (the
broadcast's backward would have summed the rows). A hook on ``E`` sums row i over the other
broadcast dims (``δ_i`` with respect to ``s``) and pulls it back to ``o`` through the chain by a
batched vector–Jacobian product over the real graph (``torch.autograd.grad(...,
is_grads_batched=True)``: the chain is not re-run, so a dropout mask in it is the one used). The
contributions of every site are summed per example (T5 adds its bias in every layer). When
``∂L/∂o`` itself arrives, the hook checks that the routed parts add up to it (every use of ``o``
was routed, up to rounding) and hands ``(u`` expanded to n``, δ)`` to the layer's rule, or to the
ghost engine's capture, exactly as for a batched call.

Anything else that would combine ``o`` with the batch — an operation outside the list above with
a batched operand, an in-place write into or from a batch-free tensor, a batch-free tensor whose
dim 0 already has the batch size combined row by row with the batch — is refused in the forward
pass with :class:`adaclip.errors.InvalidGradientError` naming the module, and so is a gradient
of ``o`` that its routed parts do not add up to: nothing is attributed to examples by guess.

Privacy. Each ``δ_i`` is row i of ``∂L/∂E``, the gradient of example i's own loss through its own
copy of ``o`` (the loss being a sum of per-example terms, the assumption every per-example rule
makes), so ``g_i = J_f^T δ_i`` is example i's gradient, and clipping it bounds example i's
contribution to the released sum: the sensitivity argument of the engines
(:mod:`adaclip_torch.engines.base`) is unchanged. Splitting ``∂L/∂o`` evenly, or treating a
non-batch dim 0 as the batch, would not be a per-example gradient; that is what this module
avoids.

Limits: batch-first layouts only (``batch_first=True``, the batch on dim 0). A module called
on batched inputs whose output does not depend on them (BART's decoder position embedding reads
the ids only for their shape) must be declared with :func:`mark_batch_free`: from its inputs it
cannot be told from a batched call, or from a module that mixes the examples. What provenance
cannot see (a model input that carries no example but whose dim 0 equals n by chance; an
explicit ``expand`` of a non-batch tensor to a dim 0 that equals n by chance) is listed in
:mod:`adaclip_torch.grad_sample._provenance`. ``nn.Embedding`` modules named
``relative_attention_bias`` (the T5 family: T5, mT5, UMT5, LongT5, …) are declared automatically.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass
from torch.utils._pytree import tree_flatten, tree_unflatten

from adaclip.errors import InvalidGradientError, InvalidHyperparameterError

from ._state import backward_muted, mute_backward

__all__ = [
    "AUTO_BATCH_FREE_NAMES",
    "BatchFreeTensor",
    "is_batch_free_module",
    "mark_batch_free",
]

Tensor = torch.Tensor

_DECLARED: weakref.WeakSet[nn.Module] = weakref.WeakSet()

#: Attribute names of ``nn.Embedding`` modules whose input never carries the batch (the T5
#: family's relative-position bias, indexed by an ``(L, L)`` bucket matrix).
AUTO_BATCH_FREE_NAMES = ("relative_attention_bias",)


def mark_batch_free(*modules: nn.Module) -> None:
    """Declare that these modules are always called on inputs that do not carry the batch.

    Calls of a declared module are routed as batch-free (module doc) whatever the shape of their
    input — needed where dim 0 of that input may equal the batch size by chance (an ``(L, L)``
    index when the sequence length equals the batch size), which would otherwise be taken for a
    batched call. Declare before the forward pass; the declaration lasts as long as the module.
    """
    for m in modules:
        if not isinstance(m, nn.Module):
            raise InvalidHyperparameterError(
                f"mark_batch_free expects nn.Module instances, got {type(m).__name__}"
            )
        _DECLARED.add(m)


def is_batch_free_module(name: str, module: nn.Module) -> bool:
    """Whether ``module`` (at ``name`` in its model) was declared batch-free, by
    :func:`mark_batch_free` or by :data:`AUTO_BATCH_FREE_NAMES`."""
    if module in _DECLARED:
        return True
    return isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in AUTO_BATCH_FREE_NAMES


class RoutedGradient:
    """The per-example gradients ``(n, *shape)`` of one output tensor of one batch-free call,
    summed over the sites where it met the batch. Holds no part of the autograd graph (the
    hook on the output's gradient keeps it)."""

    __slots__ = ("n", "where", "total")

    def __init__(self, n: int, where: str) -> None:
        self.n = n
        self.where = where
        self.total: Tensor | None = None

    def add(self, g: Tensor) -> None:
        self.total = g if self.total is None else self.total + g

    def take(self) -> Tensor | None:
        t, self.total = self.total, None
        return t


class _Source:
    """One output tensor of one batch-free call: the tensor (the input of the pull-back) and
    where its per-example gradients are summed."""

    __slots__ = ("tensor", "routed")

    def __init__(self, tensor: Tensor, routed: RoutedGradient) -> None:
        self.tensor = tensor
        self.routed = routed


class BatchFreeTensor(torch.Tensor):
    """A tensor computed from batch-free module calls without the batch (module doc).

    It is an alias of the computed tensor (same values, same autograd history); operations on
    it are intercepted (``__torch_function__``) to find where it meets the batch. Attributes:
    ``_adaclip_sources`` (the batch-free calls it derives from) and ``_adaclip_direct`` (the
    source whose output this tensor *is*, if any)."""

    _adaclip_sources: tuple[_Source, ...]
    _adaclip_direct: _Source | None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        with DisableTorchFunctionSubclass():
            return _dispatch(func, tuple(args), kwargs or {})


def wrap(t: Tensor, sources: tuple[_Source, ...], direct: _Source | None = None) -> BatchFreeTensor:
    """An alias of ``t`` tracked as batch-free."""
    with DisableTorchFunctionSubclass():
        w = t.as_subclass(BatchFreeTensor)
    w._adaclip_sources = sources
    w._adaclip_direct = direct
    return w


def new_source(output: Tensor, n: int, where: str) -> tuple[BatchFreeTensor, RoutedGradient]:
    """Track ``output`` of a batch-free call: its wrapped alias (what the model gets instead)
    and the :class:`RoutedGradient` its per-example gradients arrive in. An output that is already
    batch-free (the call's input was) keeps its upstream sources."""
    routed = RoutedGradient(n, where)
    src = _Source(output, routed)
    upstream = output._adaclip_sources if isinstance(output, BatchFreeTensor) else ()
    return wrap(output, (*upstream, src), direct=src), routed


def call_batch_size(tensors: Sequence[Any]) -> int | None:
    """The batch size n carried by batch-free tensors among ``tensors`` (``None`` if none)."""
    for t in tensors:
        if isinstance(t, BatchFreeTensor):
            return t._adaclip_sources[0].routed.n
    return None


def check_routed(where: str, total: Tensor, per_example: Tensor) -> None:
    """Raise unless the routed per-example gradients add up to the output's gradient.

    ``Σ_i δ_i = ∂L/∂o`` holds exactly when every use of the output was routed; the two sides are
    sums of the same terms in different orders, so they agree to rounding (tolerance: the larger
    of 10⁻³ and 64 units of roundoff, relative to ``Σ_i |δ_i| + |∂L/∂o|``). A use that reached the
    loss without meeting the batch leaves a difference of the order of the gradient itself."""
    with DisableTorchFunctionSubclass():
        per = per_example.to(torch.promote_types(per_example.dtype, torch.float32))
        tot = total.to(per.dtype)
        scale = per.abs().sum(0) + tot.abs()
        rtol = max(1e-3, 64 * torch.finfo(per_example.dtype).eps)
        err = (per.sum(0) - tot).abs()
        bad = err > rtol * scale + rtol * 1e-3 * (scale.max() if scale.numel() else 0.0)
        if bool(bad.any()):
            path = where.split("`")[1] if where.count("`") == 2 else None
            freeze = f"model.{path}.requires_grad_(False)" if path else "requires_grad_(False)"
            raise InvalidGradientError(
                f"{where}: its input does not carry the batch, and part of its output's gradient "
                f"(up to {float(err.max()):.3g}, of a largest entry {float(tot.abs().max()):.3g}) did not come "
                "through an operation that combines it with the batch, so it cannot be attributed to "
                "examples (an operation outside the tracked ones, or a use that reaches the loss "
                "without meeting the batch). Give the module a batched input, or freeze its "
                f"parameters ({freeze})"
            )


# ---------------------------------------------------------------------------------- dispatch

_BROADCAST_OPS = frozenset(
    {
        "add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide",
        "where", "masked_fill", "maximum", "minimum", "fmax", "fmin", "lerp", "addcmul",
        "addcdiv", "pow", "add_", "sub_", "mul_", "div_", "masked_fill_", "lerp_", "addcmul_",
        "addcdiv_", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__",
        "__mul__", "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__",
        "__pow__", "__rpow__",
    }
)  # fmt: skip
_EXPAND_OPS = frozenset({"expand", "expand_as", "broadcast_to"})
# ops that read only the shape, dtype or device of their second operand
_TEMPLATE_OPS = frozenset({"expand_as", "view_as", "reshape_as", "type_as", "to", "new_zeros", "new_ones",
                           "new_empty", "new_full"})  # fmt: skip
_INPLACE_DUNDERS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
     "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__"}
)  # fmt: skip
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})
_ATTENTION = "scaled_dot_product_attention"


def _is_inplace(name: str, kwargs: dict[str, Any]) -> bool:
    if kwargs.get("out") is not None or name in _INPLACE_DUNDERS:
        return True
    return (
        name.endswith("_")
        and not name.endswith("__")
        and not name.startswith("_")
        and name not in _NOT_WRITES
    )


def _sources(free: Sequence[BatchFreeTensor]) -> tuple[_Source, ...]:
    seen: dict[int, _Source] = {}
    for x in free:
        for s in x._adaclip_sources:
            seen.setdefault(id(s), s)
    return tuple(seen.values())


def _refuse(sources: Sequence[_Source], what: str) -> None:
    where = sorted({s.routed.where for s in sources})
    paths = [w.split("`")[1] for w in where if w.count("`") == 2]
    freeze = " or ".join(f"model.{p}.requires_grad_(False)" for p in paths) or "requires_grad_(False)"
    raise InvalidGradientError(
        f"{', '.join(where)}: called on an input that does not carry the batch (e.g. position ids of "
        "batch 1, or an index without a batch dim), so its per-example gradients are taken where its "
        f"output is combined with the batch; {what}. Supported: elementwise broadcasting (+, -, *, /, "
        "where, masked_fill, ...), .expand() to the batch, and the attn_mask of "
        "scaled_dot_product_attention. Ways out: call the module on a batched input (e.g. pass "
        "position_ids=torch.arange(L).expand(n, L)), or freeze its parameters "
        f"({freeze})"
    )


def _differentiable(out: Any) -> bool:
    return any(isinstance(t, Tensor) and t.requires_grad for t in tree_flatten(out)[0])


def _dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` (subclass dispatch disabled): propagate, route at a broadcast, or refuse."""
    leaves, spec = tree_flatten((args, kwargs))
    free = [x for x in leaves if isinstance(x, BatchFreeTensor)]
    if not free:
        return func(*args, **kwargs)
    sources = _sources(free)
    n = sources[0].routed.n
    if any(s.routed.n != n for s in sources):
        _refuse(sources, "tensors of model calls with different batch sizes meet here")
    name = getattr(func, "__name__", "")
    if name in _TEMPLATE_OPS and args and not isinstance(args[0], BatchFreeTensor):
        return func(*args, **kwargs)  # the batch-free tensor is only a template here
    batched = [
        x
        for x in leaves
        if isinstance(x, Tensor) and not isinstance(x, BatchFreeTensor) and x.ndim >= 1 and x.shape[0] == n
    ]
    inplace = _is_inplace(name, kwargs)
    grads = any(x.requires_grad for x in free)
    if name in _EXPAND_OPS and args and isinstance(args[0], BatchFreeTensor):
        return _expand_site(func, args, kwargs, n, sources)
    if batched and grads:
        if name in _BROADCAST_OPS:
            return _broadcast_site(func, leaves, spec, batched, n, sources, inplace)
        if name == _ATTENTION:
            return _attention_site(func, args, kwargs, n, sources)
    if inplace and grads:
        _refuse(sources, f"the in-place operation {name} writes into or from it (use the out-of-place form)")
    out = func(*args, **kwargs)
    if batched:
        if grads and _differentiable(out):
            _refuse(sources, f"{name or func} combines it with a batched tensor, and is not an operation whose "
                             "per-example gradient can be routed")  # fmt: skip
        return out
    return _propagate(out, leaves, sources)


def _propagate(out: Any, in_leaves: list[Any], sources: tuple[_Source, ...]) -> Any:
    """Wrap every new differentiable tensor of ``out``: still batch-free, same sources."""
    out_leaves, out_spec = tree_flatten(out)
    inputs = {id(x) for x in in_leaves if isinstance(x, Tensor)}
    changed = False
    for k, t in enumerate(out_leaves):
        if (
            isinstance(t, Tensor)
            and not isinstance(t, BatchFreeTensor)
            and t.requires_grad
            and id(t) not in inputs
        ):
            out_leaves[k] = wrap(t, sources)
            changed = True
    return tree_unflatten(out_leaves, out_spec) if changed else out


def _site(s: BatchFreeTensor, expanded: Tensor) -> Tensor:
    """``expanded`` (= ``s`` broadcast to a batched shape) with the hook that routes its rows."""
    if s.requires_grad and expanded.requires_grad:
        hook = _SiteHook(s)
        expanded.register_hook(hook)
    return expanded


def _broadcast_site(
    func: Any,
    leaves: list[Any],
    spec: Any,
    batched: list[Tensor],
    n: int,
    sources: tuple[_Source, ...],
    inplace: bool,
) -> Any:
    shapes = [tuple(x.shape) for x in leaves if isinstance(x, Tensor)]
    try:
        out_shape = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        args, kwargs = tree_unflatten(leaves, spec)
        return func(*args, **kwargs)  # torch's own shape error
    if inplace:
        if _has_out(leaves, spec) or isinstance(leaves[0], BatchFreeTensor):
            _refuse(sources, f"the in-place operation {func.__name__} writes the batch into it")
        out_shape = tuple(leaves[0].shape)
    if not out_shape or out_shape[0] != n or any(b.ndim != len(out_shape) for b in batched):
        _refuse(sources, f"{func.__name__} broadcasts it against a batched tensor whose batch is not on dim 0 "
                         f"of the result (shape {out_shape})")  # fmt: skip
    new = list(leaves)
    for k, x in enumerate(leaves):
        if not isinstance(x, BatchFreeTensor):
            continue
        if x.ndim == len(out_shape) and x.shape[0] != 1:
            _refuse(sources, f"{func.__name__} combines it row by row with the batch (its dim 0 has size "
                             f"{x.shape[0]}, not 1): its rows are not examples")  # fmt: skip
        if x.requires_grad:
            new[k] = _site(x, x.expand(out_shape))
    args, kwargs = tree_unflatten(new, spec)
    return func(*args, **kwargs)


def _has_out(leaves: list[Any], spec: Any) -> bool:
    return tree_unflatten(leaves, spec)[1].get("out") is not None


def _expand_site(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], n: int, sources: tuple[_Source, ...]
) -> Any:
    s = args[0]
    out = func(*args, **kwargs)
    to_batch = out.ndim >= 1 and out.shape[0] == n and (s.ndim < out.ndim or s.shape[0] == 1)
    if to_batch:
        return _site(s, out)  # an explicit broadcast to the batch: row i is example i's copy
    return _propagate(out, [s], sources)


def _attention_site(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], n: int, sources: tuple[_Source, ...]
) -> Any:
    names = ("query", "key", "value", "attn_mask")
    bound = {k: (args[j] if j < len(args) else kwargs.get(k)) for j, k in enumerate(names)}
    q, k, mask = bound["query"], bound["key"], bound["attn_mask"]
    if any(isinstance(bound[x], BatchFreeTensor) for x in ("query", "key", "value")) or not isinstance(
        mask, BatchFreeTensor
    ):
        _refuse(
            sources,
            "it is the query, key or value of scaled_dot_product_attention (only attn_mask is routed)",
        )
    if q.ndim < 3 or q.shape[0] != n:
        _refuse(
            sources, f"scaled_dot_product_attention with a query of shape {tuple(q.shape)}, not batch first"
        )
    target = tuple(torch.broadcast_shapes(tuple(mask.shape), (*q.shape[:-1], k.shape[-2])))
    if mask.ndim == len(target) and mask.shape[0] != 1:
        _refuse(
            sources,
            f"its dim 0 has size {mask.shape[0]}, not 1, in an attention mask: its rows are not examples",
        )
    expanded = _site(mask, mask.expand(target))
    if len(args) > 3:
        args = (*args[:3], expanded, *args[4:])
    else:
        kwargs = {**kwargs, "attn_mask": expanded}
    return func(*args, **kwargs)


class _SiteHook:
    """Gradient hook of one expansion ``E`` of a batch-free tensor ``s``: row i of ``∂L/∂E``,
    summed over the dims ``s`` was broadcast along, is example i's gradient with respect to
    ``s``; added to every source ``s`` comes from (pulled back through the chain unless ``s`` is
    the source's output itself). Holds ``s`` (upstream of ``E`` in the graph: no cycle)."""

    __slots__ = ("s",)

    def __init__(self, s: BatchFreeTensor) -> None:
        self.s = s

    def __call__(self, g: Tensor) -> None:
        if backward_muted():
            return None
        with DisableTorchFunctionSubclass():
            s = self.s
            n = int(g.shape[0])
            padded = (1,) * (g.ndim - s.ndim) + tuple(s.shape)
            dims = [d for d in range(1, g.ndim) if padded[d] == 1 and g.shape[d] != 1]
            per = (g.sum(dim=dims, keepdim=True) if dims else g).reshape(n, *s.shape)
            direct = s._adaclip_direct
            nested = []
            for src in s._adaclip_sources:
                if src is direct:
                    src.routed.add(per)
                else:
                    nested.append(src)
            if nested:
                pulled = _pull_back(s, [src.tensor for src in nested], per)
                for src, gs in zip(nested, pulled, strict=True):
                    if gs is not None:
                        src.routed.add(gs)
        return None


def _pull_back(s: Tensor, inputs: list[Tensor], per: Tensor) -> list[Tensor | None]:
    """``(n, *input.shape)``: the vector–Jacobian product of ``s`` with respect to each input for
    each example's cotangent ``per[i]``, over the recorded graph (batched; a loop where an op of
    the chain has no batching rule). Runs with the gradient hooks muted."""
    n = int(per.shape[0])
    with mute_backward():
        if n == 0:
            return [x.new_zeros((0, *x.shape)) for x in inputs]
        try:
            got = torch.autograd.grad(
                s, inputs, grad_outputs=per, retain_graph=True, allow_unused=True, is_grads_batched=True
            )
            return list(got)
        except (RuntimeError, NotImplementedError):
            rows = [torch.autograd.grad(s, inputs, grad_outputs=per[i], retain_graph=True, allow_unused=True)
                    for i in range(n)]  # fmt: skip
            return [
                None if rows[0][k] is None else torch.stack([r[k] for r in rows]) for k in range(len(inputs))
            ]
