"""Ghost norms for JAX: clipped sums without materialising per-example gradients of Dense layers.

:func:`ghost_clipped_sum_grads` has the contract of :func:`adaclip_jax.clipped_sum_grads`
(``fn(state, *args, unit_mask=None) -> ClippedSum``, to be passed to ``tx.update``) but, for
the parameters it recognises, never forms the ``n·d`` per-example gradients. It works on the
jaxpr of the *batched* loss ``L(θ) = Σ_i ℓ(θ, z_i)`` (``jax.vmap`` of the per-example loss,
summed), so pure functions need no layer library.

**What is recognised.** A parameter leaf ``W`` whose only use is (through ``transpose`` /
``reshape``, which preserve norms) one operand of a ``dot_general`` without batch dimensions,
whose other operand ``A`` carries the batch on its leading axis and does not contract it: a
Dense layer ``y = x W`` on one position or on ``T`` positions (sequences), in either operand
order. Its per-example gradient is ``g_i = Σ_t x_{it} δ_{it}ᵀ`` with ``x_{it}`` the contracted
part of ``A``'s row ``i`` at position ``t`` (``K`` long) and ``δ_{it}`` the cotangent of the
layer's output there (``F`` long), so

.. math::
    ‖g_i‖² = ‖x_i‖²‖δ_i‖²                                     (T = 1),\\qquad
    ‖g_i‖² = Σ_{t,s} (x_{it}·x_{is})(δ_{it}·δ_{is})           (T > 1),

and ``Σ_i c_i g_i`` is one product of the layer's inputs with the weighted cotangents (the
weight-gradient product of an ordinary backward pass, with the cotangent rows scaled by
``c_i``). For ``T > 1`` the Gram form costs ``~T²(K + F)`` per example; where that exceeds
``K·F`` the layer's per-example gradients are formed instead (only that layer's, as the PyTorch
ghost engine decides). A parameter leaf whose only use is (through ``broadcast_in_dim`` /
``reshape`` / ``transpose`` / ``squeeze`` / ``expand_dims``) an operand of an ``add`` whose other
operand carries the batch on its leading axis (a bias) gets its per-example gradients from the
output cotangents directly (the transpose of the broadcast, ``(n, *b.shape)``: small).
A leaf the loss does not read has the gradient 0 and costs nothing. Everything else — convolutions, a parameter used twice (tied weights, whose norm has cross
terms), a parameter used in any other way — falls back to ``vmap(grad)`` of *only those
leaves* (correct, not fast). :func:`ghost_coverage` says which leaf takes which path.

**How.** The jaxpr is traced twice, at batch sizes ``n`` and ``n + 1``: an axis whose size
differs is a batch axis, so a leading axis is known to be the batch, not an axis that happens to
have ``n`` entries. ``jit`` sub-jaxprs are inlined. The jaxpr is then re-evaluated with a zero
perturbation added to each recognised operation's output; one ``jax.vjp`` with respect to the
perturbations gives every ``δ`` (the per-example cotangents: the loss is a sum over examples
that do not interact, ``vmap`` guarantees it), and the evaluation records the inputs ``A``.

**The clip.** The per-leaf squared norms feed the core's
:func:`adaclip.strategies.group_clip_factors` (the same clip factors, grouping and auxiliary
sums — the quantile rule's count — as :func:`adaclip.strategies.clip_and_sum`), ``unit_mask``
zeroes masked units, a unit with a non-finite norm anywhere gets the factor 0 and its rows are
zeroed before the sums (so a NaN cannot reach the release), and the clipped sum of leaf ``k``
is ``(Σ_i c_i g_i − (Σ_i c_i) a_k) / b_k``, as :func:`adaclip.transform.clipped_sum` computes it.

**Rounding may over-clip, never under-clip.** Each ghost norm is an upper bound: the
``T = 1`` form is a product of two sums of squares (non-negative terms), enlarged by the
rounding margin of both reductions (:func:`adaclip.transform.rounding_margin`); the Gram form
has signed terms, so its rounding error is bounded by the margin times its magnitude
``(Σ_t ‖x_{it}‖‖δ_{it}‖)² ≥ Σ_{t,s} |x_{it}·x_{is}||δ_{it}·δ_{is}|``, which is added. Materialised
leaves (bias, fallback, long sequences) take the core's own bound
(:func:`adaclip.transform.transformed_sq_norms`).

These margins are for true float32 (or float64) arithmetic, so every matrix product that forms a
norm or a clipped sum runs at ``Precision.HIGHEST`` (:data:`NORM_PRECISION`), whatever the
user's ``jax_default_matmul_precision``: on GPUs XLA's default float32 product is TF32 (inputs
rounded to 10 mantissa bits, unit roundoff ``2^-11``), and a norm bound formed that way can fall
about ``10^-3`` (relative) below the norm of the contribution summed — under-clipping. (Seen on an
H200: the ghost norms and sums disagreed with the materialised path by more than float32
rounding, and :func:`_dense_sq_norm_coordinatewise`'s bound fell below the exact norm.) The
user's own forward and backward pass (which only supplies ``x`` and ``δ``, used alike by the norm
and the sum) keeps the user's precision; the full-precision products cost time on such GPUs.

**Strategies.** Every strategy of the affine family whose scale is per tensor or per
coordinate: flat, per-layer, scaled, quantile and automatic clipping (no centre, one scale per
tensor: the forms above, times ``1/b_k²``), and AdaCliP (a centre ``a`` and a per-coordinate
scale ``b``). For AdaCliP a Dense weight on one position takes the expansion
``‖(g_i − a)/b‖² = (x_i²)ᵀ D (δ_i²) − 2 x_iᵀ (D a) δ_i + Σ D a²`` with ``D = 1/b²`` (two
``(n × K)·(K × F)`` products, see :func:`_dense_sq_norm_coordinatewise` for its rounding
bound and the exact recomputation where the expansion cancels); on several positions its
per-example gradients are formed (no cheap form exists for a general ``D``). Centre and scale
are carried into the layer's ``(K, F)`` layout through the same chain of transposes and
reshapes as the parameter. Anything else is refused with
:class:`~adaclip.errors.InvalidHyperparameterError`.

**Privacy.** Nothing here releases anything: the result is the same not-yet-private clipped sum
as :func:`adaclip_jax.clipped_sum_grads` returns (equal up to rounding, with norms that are
upper bounds), so each unit's contribution still has transformed norm at most its clip radius
and ``tx.update`` adds the noise once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from adaclip import strategies as _strategies
from adaclip import transform as _core_transform
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_jax._grads import ArgNums, _arg_roles, _batch_size, _core_state_for, _strategy_source
from adaclip_jax._state import ClippedSum
from adaclip_jax._transform import _num_params
from adaclip_jax._validation import _validate_unit_mask

__all__ = ["ghost_clipped_sum_grads", "ghost_coverage"]

#: Operations a Dense weight may pass through before its ``dot_general``: bijections that keep
#: every coordinate (so the norm of the per-example gradient is unchanged).
_WEIGHT_CHAIN = frozenset({"transpose", "reshape"})
#: Operations a bias may pass through before its ``add`` (linear in the bias; the per-example
#: gradient is formed through their transpose, so they need not preserve norms).
_BIAS_CHAIN = frozenset({"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims"})
_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call"})


# ------------------------------------------------------------------ the flattened jaxpr
class _Eqn(NamedTuple):
    eqn: Any  # the jax equation (primitive and parameters)
    ins: tuple[int, ...]
    outs: tuple[int, ...]


class _Graph(NamedTuple):
    eqns: list[_Eqn]
    inputs: list[int]
    outputs: list[int]
    consts: dict[int, Any]
    avals: dict[int, Any]


def _flatten(closed: Any) -> _Graph:
    """The jaxpr with ``jit`` calls inlined, every value numbered in order of definition."""
    eqns: list[_Eqn] = []
    consts: dict[int, Any] = {}
    avals: dict[int, Any] = {}
    counter = [0]

    def new(aval: Any) -> int:
        counter[0] += 1
        avals[counter[0]] = aval
        return counter[0]

    def walk(jaxpr: Any, const_values: Sequence[Any], in_ids: Sequence[int]) -> list[int]:
        env: dict[Any, int] = {}
        for v, c in zip(jaxpr.constvars, const_values, strict=True):
            env[v] = new(v.aval)
            consts[env[v]] = c
        for v, i in zip(jaxpr.invars, in_ids, strict=True):
            env[v] = i

        def atom(a: Any) -> int:
            if isinstance(a, jax_core.Literal):
                i = new(a.aval)
                consts[i] = a.val
                return i
            return env[a]

        for eqn in jaxpr.eqns:
            ins = [atom(a) for a in eqn.invars]
            if eqn.primitive.name in _INLINE and "jaxpr" in eqn.params:
                inner = eqn.params["jaxpr"]
                inner_jaxpr, inner_consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
                outs = walk(inner_jaxpr, inner_consts, ins)
                for v, o in zip(eqn.outvars, outs, strict=True):
                    env[v] = o
                continue
            outs = [new(v.aval) for v in eqn.outvars]
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
            eqns.append(_Eqn(eqn, tuple(ins), tuple(outs)))
        return [atom(v) for v in jaxpr.outvars]

    inputs = [new(v.aval) for v in closed.jaxpr.invars]
    outputs = walk(closed.jaxpr, closed.consts, inputs)
    return _Graph(eqns, inputs, outputs, consts, avals)


def _batch_axes(small: _Graph, large: _Graph) -> dict[int, tuple[int, ...]] | None:
    """For each value, the axes whose size differs between the two traces (batch ``n`` and
    ``n + 1``): the batch axes. ``None`` when the traces differ in structure."""
    if len(small.eqns) != len(large.eqns) or len(small.avals) != len(large.avals):
        return None
    for a, b in zip(small.eqns, large.eqns, strict=True):
        if a.eqn.primitive is not b.eqn.primitive or a.ins != b.ins or a.outs != b.outs:
            return None
    axes = {}
    for i, aval in small.avals.items():
        other = large.avals.get(i)
        shape_a, shape_b = getattr(aval, "shape", ()), getattr(other, "shape", ())
        if other is None or len(shape_a) != len(shape_b):
            return None
        axes[i] = tuple(d for d, (p, q) in enumerate(zip(shape_a, shape_b, strict=True)) if p != q)
    return axes


# ------------------------------------------------------------------ the taps
class _Tap(NamedTuple):
    kind: str  # "dense" or "bias"
    leaf: int  # parameter leaf index
    chain: tuple[int, ...]  # indices into graph.eqns: the parameter's path to the op
    op: int  # index of the dot_general / add
    param_side: int  # 0 or 1: which operand of the op the parameter's path reaches


def _uses(graph: _Graph) -> dict[int, list[tuple[int, int]]]:
    uses: dict[int, list[tuple[int, int]]] = {}
    for k, e in enumerate(graph.eqns):
        for pos, i in enumerate(e.ins):
            uses.setdefault(i, []).append((k, pos))
    for i in graph.outputs:
        uses.setdefault(i, []).append((-1, 0))
    return uses


def _find_tap(graph: _Graph, axes: dict[int, tuple[int, ...]], uses: Any, leaf: int, start: int) -> _Tap | None:
    """The Dense or bias use of parameter leaf ``leaf`` (value ``start``), or ``None``."""
    chain: list[int] = []
    cur = start
    while True:
        found = uses.get(cur, [])
        if len(found) != 1 or found[0][0] < 0:
            return None  # unused, used twice (tied), or an output
        k, pos = found[0]
        e = graph.eqns[k]
        name = e.eqn.primitive.name
        if axes.get(e.outs[0], ()) != () and name not in ("dot_general", "add"):
            return None
        if name in _BIAS_CHAIN and len(e.ins) == 1 and len(e.outs) == 1:
            chain.append(k)
            cur = e.outs[0]
            continue
        if len(e.ins) != 2 or len(e.outs) != 1:
            return None
        other = e.ins[1 - pos]
        if other in graph.consts or axes.get(other) != (0,):
            return None
        if name == "dot_general":
            (contract, batch) = e.eqn.params["dimension_numbers"]
            if any(len(b) for b in batch) or 0 in tuple(contract[1 - pos]):
                return None
            if any(graph.eqns[c].eqn.primitive.name not in _WEIGHT_CHAIN for c in chain):
                return None
            return _Tap("dense", leaf, tuple(chain), k, pos)
        if name == "add" and axes.get(e.outs[0]) == (0,) and len(graph.avals[cur].shape) == len(graph.avals[e.outs[0]].shape):
            return _Tap("bias", leaf, tuple(chain), k, pos)
        return None


#: The precision of every product that forms a ghost norm or a clipped sum (see the module
#: docstring: the rounding margins assume true float32 products; TF32 would under-clip).
NORM_PRECISION = jax.lax.Precision.HIGHEST


def _bind(e: _Eqn, vals: Sequence[Any], *, full_precision: bool = False) -> list[Any]:
    """Bind equation ``e`` to ``vals``; ``full_precision``: a ``dot_general`` runs at
    :data:`NORM_PRECISION` whatever precision the user's jaxpr recorded (for the clipped sum)."""
    bound = e.eqn.primitive.get_bind_params(e.eqn.params)
    # jax >= 0.7 returns the parameters; older versions (subfuns, parameters)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    if full_precision and e.eqn.primitive.name == "dot_general":
        params = {**params, "precision": (NORM_PRECISION, NORM_PRECISION)}
    with e.eqn.ctx.manager:
        out = e.eqn.primitive.bind(*subfuns, *vals, **params)
    return list(out) if e.eqn.primitive.multiple_results else [out]


def _eval(graph: _Graph, inputs: Sequence[Any], perturb: dict[int, Any]) -> tuple[Any, dict[int, Any]]:
    """Evaluate the flattened jaxpr; ``perturb[k]`` is added to equation ``k``'s output.
    Returns the outputs and every value (for the taps' inputs)."""
    env: dict[int, Any] = dict(graph.consts)
    env.update(zip(graph.inputs, inputs, strict=True))
    for k, e in enumerate(graph.eqns):
        outs = _bind(e, [env[i] for i in e.ins])
        if k in perturb:
            outs = [outs[0] + perturb[k]]
        env.update(zip(e.outs, outs, strict=True))
    return [env[i] for i in graph.outputs], env


def _apply_chain(graph: _Graph, chain: Sequence[int], value: Any) -> Any:
    for k in chain:
        (value,) = _bind(graph.eqns[k], [value])
    return value


# ------------------------------------------------------------------ the plan
class _Plan(NamedTuple):
    graph: _Graph
    taps: dict[int, _Tap]  # leaf index -> its tap
    fallback: tuple[int, ...]  # leaf indices taking vmap(grad)
    unused: tuple[int, ...]  # leaf indices the loss does not read: gradient exactly 0


def _batched_loss(loss_fn: Callable[..., Any], argnums: int, batch_set: frozenset[int], treedefs: Sequence[Any]):
    """``(*leaves) -> Σ_i ℓ_i``: the loss summed over the batch, on the flattened arguments."""
    sizes = [t.num_leaves for t in treedefs]

    def fn(*leaves):
        args, start = [], 0
        for t, s in zip(treedefs, sizes, strict=True):
            args.append(jax.tree_util.tree_unflatten(t, leaves[start : start + s]))
            start += s
        in_axes = tuple(0 if i in batch_set else None for i in range(len(args)))
        losses = jax.vmap(loss_fn, in_axes=in_axes)(*args)
        if jnp.shape(losses) != (jnp.shape(losses)[0],):
            raise InvalidGradientError(f"loss_fn must return a scalar per example, got shape {jnp.shape(losses)[1:]}")
        return jnp.sum(losses)

    return fn


def _plan(loss_fn: Callable[..., Any], args: Sequence[Any], argnums: int, batch_set: frozenset[int]) -> _Plan:
    flat = [jax.tree_util.tree_flatten(a) for a in args]
    treedefs = [t for _, t in flat]
    fn = _batched_loss(loss_fn, argnums, batch_set, treedefs)

    def spec(grow: int) -> list[Any]:
        out = []
        for i, (leaves, _) in enumerate(flat):
            for x in leaves:
                shape = tuple(jnp.shape(x))
                if i in batch_set:
                    shape = (shape[0] + grow,) + shape[1:]
                out.append(jax.ShapeDtypeStruct(shape, jnp.result_type(x)))
        return out

    graph = _flatten(jax.make_jaxpr(fn)(*spec(0)))
    offset = sum(len(leaves) for leaves, _ in flat[:argnums])
    num = len(flat[argnums][0])
    taps: dict[int, _Tap] = {}
    uses = _uses(graph)
    unused = tuple(k for k in range(num) if not uses.get(graph.inputs[offset + k]))
    axes = _batch_axes(graph, _flatten(jax.make_jaxpr(fn)(*spec(1))))
    if axes is not None:
        for leaf in range(num):
            tap = _find_tap(graph, axes, uses, leaf, graph.inputs[offset + leaf])
            if tap is not None:
                taps[leaf] = tap
    return _Plan(graph, taps, tuple(k for k in range(num) if k not in taps and k not in unused), unused)


def ghost_coverage(
    loss_fn: Callable[..., Any],
    *args: Any,
    argnums: int = 0,
    batch_argnums: ArgNums = 1,
    shared_argnums: ArgNums = (),
) -> Any:
    """Which path each parameter leaf takes in :func:`ghost_clipped_sum_grads`: a pytree with
    the parameters' structure holding ``"dense"`` (ghost norm of a ``dot_general``), ``"bias"``
    (per-example gradient from the output cotangents), ``"unused"`` (the loss does not read it:
    gradient 0) or ``"fallback"`` (``vmap(grad)``).

    The arguments' roles are those of :func:`ghost_clipped_sum_grads`, checked the same way: an
    argument outside ``argnums``, ``batch_argnums`` and ``shared_argnums`` holding an array with
    the batch's leading size is refused (:class:`InvalidHyperparameterError`), so the coverage
    reported is that of a call that would run."""
    roles = _arg_roles(argnums, batch_argnums, shared_argnums)
    _batch_size(args, roles)
    plan = _plan(loss_fn, args, argnums, roles.batched)
    leaves, treedef = jax.tree_util.tree_flatten(args[argnums])
    names = [plan.taps[k].kind if k in plan.taps else "unused" if k in plan.unused else "fallback"
             for k in range(len(leaves))]  # fmt: skip
    return jax.tree_util.tree_unflatten(treedef, names)


# ------------------------------------------------------------------ the norms
def _dense_layout(graph: _Graph, tap: _Tap, a: Any, delta: Any) -> tuple[Any, Any]:
    """``x`` as ``(n, T, K)`` and ``δ`` as ``(n, T, F)`` from the operand ``a`` and the output
    cotangent ``delta`` of a Dense ``dot_general`` (``T`` positions, ``K`` contracted, ``F``
    the parameter's free coordinates)."""
    e = graph.eqns[tap.op]
    (contract, _) = e.eqn.params["dimension_numbers"]
    act_side = 1 - tap.param_side
    c_act = tuple(int(d) for d in contract[act_side])
    c_par = tuple(int(d) for d in contract[tap.param_side])
    par_rank = len(graph.avals[e.ins[tap.param_side]].shape)
    free_act = [d for d in range(a.ndim) if d not in c_act]  # batch (axis 0) first
    n = a.shape[0]
    positions = math.prod(a.shape[d] for d in free_act[1:])
    k = math.prod(a.shape[d] for d in c_act)
    x = jnp.transpose(a, free_act + list(c_act)).reshape(n, positions, k)
    num_free_par = par_rank - len(c_par)
    # dot_general output: lhs free dims, then rhs free dims
    if act_side == 0:
        act_axes = list(range(len(free_act)))
        par_axes = list(range(len(free_act), len(free_act) + num_free_par))
    else:
        par_axes = list(range(num_free_par))
        act_axes = list(range(num_free_par, num_free_par + len(free_act)))
    f = math.prod(delta.shape[d] for d in par_axes)
    d = jnp.transpose(delta, act_axes + par_axes).reshape(n, positions, f)
    return x, d


def _dense_sq_norm(x: Any, d: Any, inv_scale: Any) -> Any:
    """Upper bound of ``‖g_i/b‖²`` for ``g_i = Σ_t x_{it} δ_{it}ᵀ`` (see the module docstring)."""
    _, positions, k = x.shape
    f = d.shape[2]
    u = _core_transform.unit_roundoff(x.dtype)
    r2 = inv_scale * inv_scale
    if positions == 1:
        sq = jnp.sum(x[:, 0] * x[:, 0], axis=1) * jnp.sum(d[:, 0] * d[:, 0], axis=1)
        margin = _core_transform.rounding_margin(x.dtype, k) + _core_transform.rounding_margin(x.dtype, f) + 8 * u
        return sq * r2 * (1.0 + margin)
    if positions * (k + f) <= k * f:
        gram_x = jnp.einsum("ntk,nsk->nts", x, x, precision=NORM_PRECISION)
        gram_d = jnp.einsum("ntf,nsf->nts", d, d, precision=NORM_PRECISION)
        sq = jnp.sum(gram_x * gram_d, axis=(1, 2))
        magnitude = jnp.sum(jnp.linalg.norm(x, axis=2) * jnp.linalg.norm(d, axis=2), axis=1) ** 2
        margin = (
            _core_transform.rounding_margin(x.dtype, k)
            + _core_transform.rounding_margin(x.dtype, f)
            + _core_transform.rounding_margin(x.dtype, positions * positions)
            + 12 * u
        )
        return jnp.maximum(sq + margin * magnitude, 0.0) * r2 * (1.0 + 4 * u)
    g = jnp.einsum("ntk,ntf->nkf", x, d, precision=NORM_PRECISION)  # long sequences: per-example gradients
    return _core_transform.transformed_sq_norms([g], None, [1.0 / inv_scale])[0]


#: A ghost bound whose rounding-error term exceeds this fraction of it is replaced by the exact
#: norm from the layer's formed per-example gradients (as the PyTorch ghost engine does).
OVERCLIP_TOLERANCE = 1e-2


def _to_matrix(graph: _Graph, tap: _Tap, t: Any) -> Any:
    """A leaf-shaped array (centre, scale) in the ``(K, F)`` layout of ``x_iᵀ δ_i``: through
    the parameter's chain to the ``dot_general`` operand, then contracted axes first."""
    v = _apply_chain(graph, tap.chain, t)
    (contract, _) = graph.eqns[tap.op].eqn.params["dimension_numbers"]
    c_par = [int(d) for d in contract[tap.param_side]]
    free = [d for d in range(v.ndim) if d not in c_par]
    k = math.prod(v.shape[d] for d in c_par)
    return jnp.transpose(v, c_par + free).reshape(k, -1)


def _dense_sq_norm_coordinatewise(x: Any, d: Any, centre: Any, scale: Any) -> Any:
    """Upper bound of ``‖(g_i − a)/b‖²`` for a Dense weight with a per-coordinate scale ``b``
    and optionally a centre ``a`` (both ``(K, F)``), ``g_i = Σ_t x_{it} δ_{it}ᵀ``.

    With ``D = 1/b²`` and one position: ``A = Σ D g² = (x_i²)ᵀ D (δ_i²)``,
    ``B = Σ (D a) g = x_iᵀ (D a) δ_i``, ``C = Σ D a²``, ``‖(g_i − a)/b‖² = A − 2B + C``. The
    expansion cancels when ``C`` is large against the result, so the rounding error is bounded
    by the reductions' margin times ``(√A + √C)² ≥ A + 2Σ|terms of B| + C`` (Cauchy–Schwarz)
    and added; where that error exceeds :data:`OVERCLIP_TOLERANCE` of the bound, the unit's norm
    is recomputed from its formed gradient (the core's direct bound), one unit at a time so the
    memory stays ``O(K·F)``. Several positions: no cheap form for a general ``D``, the layer's
    per-example gradients are formed.
    """
    _, positions, k = x.shape
    f = d.shape[2]
    rm, u = _core_transform.rounding_margin, _core_transform.unit_roundoff(x.dtype)

    def exact():
        g = jnp.einsum("ntk,ntf->nkf", x, d, precision=NORM_PRECISION)
        return _core_transform.transformed_sq_norms([g], None if centre is None else [centre], [scale])[0]

    if positions > 1:
        return exact()
    inv = 1.0 / scale
    dm = inv * inv
    x1, d1 = x[:, 0], d[:, 0]
    a_sq = jnp.sum(jnp.matmul(x1 * x1, dm, precision=NORM_PRECISION) * (d1 * d1), axis=1)
    sq_margin = rm(x.dtype, k) + rm(x.dtype, f) + 8 * u
    if centre is None:
        return a_sq * (1.0 + sq_margin)
    lin = jnp.sum(jnp.matmul(x1, dm * centre, precision=NORM_PRECISION) * d1, axis=1)
    const = jnp.sum(dm * centre * centre)
    estimate = a_sq - 2.0 * lin + const
    magnitude = (jnp.sqrt(jnp.maximum(a_sq * (1.0 + sq_margin), 0.0)) + jnp.sqrt(const)) ** 2
    margin = max(sq_margin, rm(x.dtype, k) + rm(x.dtype, f) + 8 * u, rm(x.dtype, k * f) + 8 * u) + 4 * u
    error = margin * magnitude
    bound = jnp.maximum(estimate + error, 0.0)
    loose = error > OVERCLIP_TOLERANCE * bound  # False for NaN: a non-finite unit stays so

    def one(args):  # the direct bound of one unit, formed only where its ghost bound is loose
        xi, di, is_loose, b = args
        direct = lambda: _core_transform.transformed_sq_norms(  # noqa: E731
            [jnp.outer(xi, di)[None]], None if centre is None else [centre], [scale]
        )[0][0]
        return jax.lax.cond(is_loose, direct, lambda: b)

    # Memory O(K·F): one unit's gradient at a time, and only on a step where some unit needs it.
    return jax.lax.cond(jnp.any(loose), lambda: jax.lax.map(one, (x1, d1, loose, bound)), lambda: bound)


def _bias_samples(graph: _Graph, tap: _Tap, param: Any, delta: Any) -> Any:
    """Per-example gradients ``(n, *b.shape)`` of a bias: the transpose of its broadcast
    applied to each example's output cotangent."""
    e = graph.eqns[tap.op]
    side_shape = graph.avals[e.ins[tap.param_side]].shape
    out_shape = delta.shape

    def expand(p):
        return jnp.broadcast_to(_apply_chain(graph, tap.chain, p), (1,) + tuple(out_shape[1:]))

    if len(side_shape) != len(out_shape):  # excluded by _find_tap
        raise InvalidGradientError("unsupported bias broadcast")
    _, pullback = jax.vjp(expand, param)
    return jax.vmap(lambda di: pullback(di[None])[0])(delta)


# ------------------------------------------------------------------ the public function
def ghost_clipped_sum_grads(
    loss_fn: Callable[..., Any],
    tx: Any,
    *,
    argnums: int = 0,
    batch_argnums: ArgNums = 1,
    shared_argnums: ArgNums = (),
) -> Callable[..., Any]:
    """:func:`adaclip_jax.clipped_sum_grads` with ghost norms for Dense layers (see the module
    docstring for the maths, what is covered and what falls back).

    Args:
      loss_fn: per-example loss, as for :func:`adaclip_jax.per_example_grads` (no ``has_aux``);
        a pure function of JAX arrays (no layer library needed).
      tx: a transformation of this package (:func:`flat_clip`, :func:`per_layer_clip`,
        :func:`scaled_clip`, :func:`quantile_clip`, :func:`automatic_clip`, :func:`adaclip`;
        in a chain, the private element).
      argnums: which argument holds the parameters.
      batch_argnums: which arguments carry the batch axis (``loss_fn(params, x, y)``:
        ``(1, 2)``).
      shared_argnums: arguments every example reads whole although a leaf's leading size may
        equal the batch's (see :func:`adaclip_jax.per_example_grads`).

    Returns:
      ``fn(state, *args, unit_mask=None) -> ClippedSum``: pass the result to ``tx.update`` (or
      the chain's) in place of per-unit gradients. Not private by itself.

    Raises:
      InvalidHyperparameterError: ``tx`` is not a transformation of this package, or its
        strategy's centre or scale is neither per tensor nor per coordinate: refused rather
        than approximated; raised at the first call (trace time), before anything changes.
        Also, at the first call and before ``loss_fn`` is traced, an argument outside
        ``argnums``, ``batch_argnums`` and ``shared_argnums`` that holds an array with the
        batch's leading size: every unit would read all of it (e.g. every label), and the
        clipped sum's sensitivity would exceed ``2·C``.
    """
    strategy_for = _strategy_source(tx)
    roles = _arg_roles(argnums, batch_argnums, shared_argnums)
    batch_set = roles.batched

    def compute(state, *args, unit_mask=None):
        n = _batch_size(args, roles)
        params = args[argnums]
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        num = len(p_leaves)
        strategy = strategy_for(_num_params([tuple(p.shape) for p in p_leaves]))
        core_state, dtypes = _core_state_for(state, p_leaves)
        centre, scale = strategy.transform(core_state, num)
        if any(jnp.ndim(b) != 0 and jnp.shape(b) != p.shape for b, p in zip(scale, p_leaves, strict=True)) or (
            centre is not None and any(jnp.shape(a) != p.shape for a, p in zip(centre, p_leaves, strict=True))
        ):
            raise InvalidHyperparameterError(
                f"ghost_clipped_sum_grads: {type(strategy).__name__}'s centre or scale is neither per "
                "tensor nor per coordinate: use clipped_sum_grads"
            )
        coordinatewise = centre is not None or any(jnp.ndim(b) != 0 for b in scale)
        centre_of = (lambda k: None) if centre is None else (lambda k: [centre[k]])  # noqa: E731
        if unit_mask is not None:
            unit_mask = _validate_unit_mask(unit_mask, n)

        plan = _plan(loss_fn, args, argnums, batch_set)
        graph = plan.graph
        flat_args = [leaf for a in args for leaf in jax.tree_util.tree_leaves(a)]

        # Pass 1: every tap's output cotangent δ, and its inputs, from one vjp.
        ops = {tap.op: tap for tap in plan.taps.values()}
        zeros = {k: jnp.zeros(graph.avals[graph.eqns[k].outs[0]].shape, graph.avals[graph.eqns[k].outs[0]].dtype)
                 for k in ops}  # fmt: skip

        def perturbed(perturb):
            outs, env = _eval(graph, flat_args, perturb)
            recorded = {k: env[graph.eqns[k].ins[1 - tap.param_side]] for k, tap in ops.items() if tap.kind == "dense"}
            return outs[0], recorded

        if ops:
            loss, pullback, inputs = jax.vjp(perturbed, zeros, has_aux=True)
            (deltas,) = pullback(jnp.ones_like(loss))
        else:
            deltas, inputs = {}, {}

        # Fallback leaves: vmap(grad) of only those leaves.
        fallback: dict[int, Any] = {}
        if plan.fallback:
            def loss_of(sub, *a):
                leaves = list(p_leaves)
                for k, v in zip(plan.fallback, sub, strict=True):
                    leaves[k] = v
                full = list(a)
                full[argnums] = jax.tree_util.tree_unflatten(treedef, leaves)
                return loss_fn(*full)

            sub = [p_leaves[k] for k in plan.fallback]
            in_axes = (None,) + roles.in_axes(len(args))
            grads = jax.vmap(jax.grad(loss_of), in_axes=in_axes)(sub, *args)
            fallback = {k: g.astype(dtypes[k]) for k, g in zip(plan.fallback, grads, strict=True)}

        # Norms and sums at NORM_PRECISION: the rounding margins assume true float32 products.
        with jax.default_matmul_precision("highest"):
            # Per-leaf squared-norm bounds.
            sq_norms: list[Any] = [None] * num
            dense: dict[int, tuple[Any, Any]] = {}
            samples: dict[int, Any] = dict(fallback)
            for leaf, tap in plan.taps.items():
                delta = deltas[tap.op].astype(dtypes[leaf])
                if tap.kind == "dense":
                    a = inputs[tap.op].astype(dtypes[leaf])
                    x, d = _dense_layout(graph, tap, a, delta)
                    dense[leaf] = (a, delta)
                    if coordinatewise:
                        shape = p_leaves[leaf].shape
                        b_mat = _to_matrix(graph, tap, jnp.broadcast_to(jnp.asarray(scale[leaf], dtypes[leaf]), shape))
                        a_mat = None if centre is None else _to_matrix(graph, tap, centre[leaf].astype(dtypes[leaf]))
                        sq_norms[leaf] = _dense_sq_norm_coordinatewise(x, d, a_mat, b_mat)
                    else:
                        inv = jnp.asarray(1.0, dtypes[leaf]) / jnp.asarray(scale[leaf], dtypes[leaf])
                        sq_norms[leaf] = _dense_sq_norm(x, d, inv)
                else:
                    samples[leaf] = _bias_samples(graph, tap, p_leaves[leaf].astype(dtypes[leaf]), delta)
            for leaf, g in samples.items():
                sq_norms[leaf] = _core_transform.transformed_sq_norms([g], centre_of(leaf), [scale[leaf]])[0]
            for leaf in plan.unused:
                sq_norms[leaf] = jnp.zeros((n,), dtypes[leaf])

            # The core's clip factors, mask, dropped units and auxiliary sums (as clip_and_sum).
            factors = _strategies.group_clip_factors(strategy, sq_norms)
            if unit_mask is not None:
                factors = [jnp.where(unit_mask, c, jnp.zeros_like(c)) for c in factors]
            nonfinite = _core_transform.nonfinite_units(sq_norms)
            aux = _strategies.auxiliary_sums(strategy, core_state, sq_norms, factors)

            summed: list[Any] = [jnp.zeros(p_leaves[k].shape, dtypes[k]) if k in plan.unused else None for k in range(num)]
            for leaf, g in samples.items():
                summed[leaf] = _core_transform.clipped_sum(
                    [g], centre_of(leaf), [scale[leaf]], [factors[leaf]], nonfinite=nonfinite
                )[0]
            for leaf, (a, delta) in dense.items():
                tap = plan.taps[leaf]
                c = factors[leaf].astype(dtypes[leaf])
                keep = jnp.logical_not(nonfinite)
                a_kept = jnp.where(keep.reshape((n,) + (1,) * (a.ndim - 1)), a, 0)
                batch_out = 0 if tap.param_side == 1 else delta.ndim - (a.ndim - len(_contracted(graph, tap)))
                shape = [1] * delta.ndim
                shape[batch_out] = n
                weighted = jnp.where(keep.reshape(shape), delta, 0) * c.reshape(shape)
                total = _weight_sum(graph, tap, a_kept, weighted, p_leaves[leaf].astype(dtypes[leaf]))
                if centre is not None:  # Σ_i c_i (g_i − a) = Σ_i c_i g_i − (Σ_i c_i) a, as the core
                    total = total - jnp.sum(c) * centre[leaf]
                summed[leaf] = total / scale[leaf]
            return ClippedSum(jax.tree_util.tree_unflatten(treedef, summed), tuple(aux))

    return compute


def _contracted(graph: _Graph, tap: _Tap) -> tuple[int, ...]:
    (contract, _) = graph.eqns[tap.op].eqn.params["dimension_numbers"]
    return tuple(contract[1 - tap.param_side])


def _weight_sum(graph: _Graph, tap: _Tap, a: Any, cotangent: Any, param: Any) -> Any:
    """``Σ_i c_i g_i`` in the parameter's layout: the transpose of ``p ↦ op(a, chain(p))``
    applied to the weighted cotangents (the weight-gradient product of a backward pass)."""
    e = graph.eqns[tap.op]

    def op(p):
        v = _apply_chain(graph, tap.chain, p)
        vals = [a, v] if tap.param_side == 1 else [v, a]
        return _bind(e, vals, full_precision=True)[0]

    _, pullback = jax.vjp(op, param)
    return pullback(cotangent.astype(graph.avals[e.outs[0]].dtype))[0]

