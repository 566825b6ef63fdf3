"""The model rewritten to hand back what the hooks would capture: the ``torch.fx`` half of the
compiled region's capture method (:mod:`adaclip_torch.compiled`).

The hooks learn each layer call's input ``x`` and output gradient ``δ = ∂L/∂y`` while an eager
``loss.backward()`` runs. Under ``torch.compile`` they cannot (their Python runs at every
operation), so the region asks for the same numbers as values of one function. The model is
traced with :mod:`torch.fx` (every module with a grad-sample rule kept as one call), and each
such call ``y = m(x)`` is rewritten to ``y + p`` with a zero *probe* ``p`` of ``y``'s shape, an
extra input of the graph. For the summed per-example losses ``L = Σ_i ℓ_i``,

.. math::

    \\frac{∂L}{∂p} = \\frac{∂L}{∂y} = δ,

and because ``ℓ_i`` depends on row ``i`` of ``y`` only (the examples do not interact: batch
normalisation is refused when the optimizer is built), row ``i`` of ``δ`` is example ``i``'s own
output gradient — exactly what the hooks capture under ``loss_reduction="sum"``. The graph also
returns every call's inputs. ``torch.func.grad`` with respect to the probes then gives all the
``δ`` in one backward pass that computes no weight gradient at all (no ``δᵀx`` product: the
probes are the only inputs differentiated), and the whole function compiles.

**What is refused, and why (privacy).** Row ``i`` of a captured input is taken for example
``i``'s. That holds for a tensor computed from the model's input batch; it does not for one
that is not (a position index ``arange(L)``, a buffer, a parameter): its rows are not
examples, and taking them for examples would let one example move the sum by more than the
clip norm. The trace shows where every tensor comes from, so a rule-carrying call whose tensor
inputs do not all descend from the batch (through tensor operations: a size read off the batch,
``x.size(0)``, carries no example) is refused when the region is built. The hooks route such
calls (``adaclip_torch.grad_sample.batch_free``); here the error says to use them. Also
refused: a parameter used outside a module with a rule (the hooks' ``torch.func`` fallback has
no form here), keyword arguments to a rule-carrying call, and models ``torch.fx`` cannot trace
(data-dependent control flow). At run time every captured tensor must have the batch's size on
dim 0.
"""

from __future__ import annotations

import copy as copy_module
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from adaclip.errors import InvalidHyperparameterError

__all__ = ["CaptureGraph", "trace_for_capture"]

Tensor = torch.Tensor

#: Tensor methods and attributes whose result describes a tensor without carrying its rows
#: (sizes, dtypes): a value built from them alone is not a function of any example.
_SHAPE_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "stride", "get_device"})
_SHAPE_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout"})


class _KeepRuled(fx.Tracer):
    """Traces through every module except those with a grad-sample rule (and torch's own
    leaves, which :meth:`trace_for_capture` then checks own no trainable parameter)."""

    def __init__(self, ruled: set[nn.Module]) -> None:
        super().__init__()
        self._ruled = ruled

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return m in self._ruled or super().is_leaf_module(m, module_qualified_name)


@dataclass(eq=False)
class CaptureGraph:
    """The rewritten model (see the module doc).

    ``module(x, *probes) -> (output, inputs)``: the model's output for the batch ``x`` with
    ``probes[k]`` added to the output of rule-carrying call ``k``, and ``inputs[k]`` the
    positional inputs of that call. ``calls[k]`` is its module; :meth:`probes` builds zero
    probes for a batch (their shapes are found once per input shape, by one eager forward
    pass of the traced model)."""

    module: fx.GraphModule
    calls: tuple[nn.Module, ...]
    _traced: fx.GraphModule
    _nodes: tuple[fx.Node, ...]
    _shapes: dict[tuple[Any, ...], list[tuple[torch.Size, torch.dtype]]] = field(default_factory=dict)

    def probes(self, x: Tensor) -> tuple[Tensor, ...]:
        key = (tuple(x.shape), x.dtype, x.device)
        shapes = self._shapes.get(key)
        if shapes is None:
            with torch.no_grad():
                ShapeProp(self._traced).propagate(x)
            shapes = [(node.meta["tensor_meta"].shape, node.meta["tensor_meta"].dtype) for node in self._nodes]
            self._shapes[key] = shapes
        return tuple(torch.zeros(s, dtype=dt, device=x.device) for s, dt in shapes)


def _descendants_of(graph: fx.Graph, source: fx.Node) -> set[fx.Node]:
    """The nodes whose value is computed from ``source``'s rows through tensor operations
    (a size or dtype read off a tensor stops the descent: it carries no row)."""
    out = {source}
    for node in graph.nodes:
        if node is source or node.op in ("placeholder", "output"):
            continue
        if node.op == "call_method" and node.target in _SHAPE_METHODS:
            continue
        if node.op == "call_function" and node.target is getattr and node.args[1] in _SHAPE_ATTRIBUTES:
            continue
        if any(n in out for n in node.all_input_nodes):
            out.add(node)
    return out


def trace_for_capture(model: nn.Module, ruled: set[nn.Module], params: Iterable[Tensor]) -> CaptureGraph:
    """Trace ``model`` (one positional input, the batch) keeping the modules in ``ruled`` as
    calls, check that the privatised ``params`` are all reached through them and that their
    inputs descend from the batch, and rewrite each call to add a probe (the module doc).

    Raises:
        InvalidHyperparameterError: the model cannot be traced, or a check fails (the message
            names the module or parameter, and says to use the hooks instead).
    """
    try:
        graph = _KeepRuled(ruled).trace(model)
    except Exception as exc:  # torch.fx raises many types for untraceable Python
        raise InvalidHyperparameterError(
            f"the capture method traces the model with torch.fx, which failed ({type(exc).__name__}: {exc}); "
            "use method='vmap', or the hooks without the region"
        ) from exc
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise InvalidHyperparameterError(
            f"the capture method needs a model with one positional input (the batch); its forward takes "
            f"{[n.target for n in placeholders]}"
        )
    private = {id(p) for p in params}
    owned: dict[int, str] = {}
    for path, m in model.named_modules():
        for name, p in m._parameters.items():
            if p is not None and id(p) in private:
                owned.setdefault(id(p), f"{path}.{name}" if path else name)
    from_batch = _descendants_of(graph, placeholders[0])
    for node in graph.nodes:
        if node.op == "get_attr":
            held = operator.attrgetter(str(node.target))(model)
            if isinstance(held, Tensor) and id(held) in private:
                raise InvalidHyperparameterError(
                    f"parameter {node.target!r} is used outside a module call; the capture method reaches "
                    "parameters only through modules with a grad-sample rule (use method='vmap')"
                )
    calls: list[tuple[fx.Node, nn.Module]] = []
    for node in graph.nodes:
        if node.op != "call_module":
            continue
        m = model.get_submodule(str(node.target))
        trainable = [p for p in m.parameters() if id(p) in private]
        if not trainable:
            continue
        if m not in ruled:
            raise InvalidHyperparameterError(
                f"{type(m).__name__} `{node.target}` gets its per-example gradients from the hooks' torch.func "
                "fallback (its type has no grad-sample rule, or a parent module that owns parameters itself "
                "covers it); the capture method has no such form: use method='vmap'"
            )
        if node.kwargs:
            raise InvalidHyperparameterError(
                f"{type(m).__name__} `{node.target}` is called with keyword arguments {sorted(node.kwargs)}; "
                "the capture method passes a rule the positional inputs only: use method='vmap'"
            )
        stray = [a for a in node.all_input_nodes if a not in from_batch]  # nested arguments too
        if stray:
            raise InvalidHyperparameterError(
                f"{type(m).__name__} `{node.target}` is called on {[a.name for a in stray]}, which are not "
                "computed from the batch: their rows are not examples. The hooks route such calls to the "
                "examples that use them; build the optimizer with its hooks and drop the region"
            )
        calls.append((node, m))
    reached = {id(p) for _, m in calls for p in m.parameters()}
    missing = [name for pid, name in owned.items() if pid not in reached]
    if missing:
        raise InvalidHyperparameterError(
            f"parameters {missing} are not reached through a module call of the traced model; the capture "
            "method cannot give them per-example gradients: use method='vmap'"
        )
    traced = fx.GraphModule(model, graph)
    rewired = _with_probes(model, graph, [node for node, _ in calls])
    return CaptureGraph(module=rewired, calls=tuple(m for _, m in calls), _traced=traced,
                        _nodes=tuple(_same_nodes(traced.graph, [node for node, _ in calls])))  # fmt: skip


def _same_nodes(graph: fx.Graph, nodes: list[fx.Node]) -> list[fx.Node]:
    by_name = {n.name: n for n in graph.nodes}
    return [by_name[n.name] for n in nodes]


def _with_probes(model: nn.Module, graph: fx.Graph, calls: list[fx.Node]) -> fx.GraphModule:
    """A copy of ``graph`` where call ``k``'s output gets ``probe_k`` added (a new input) and
    the output becomes ``(output, (inputs of call 0), (inputs of call 1), …)``."""
    copy = copy_module.deepcopy(graph)
    nodes = _same_nodes(copy, calls)
    first_body = next(n for n in copy.nodes if n.op != "placeholder")
    with copy.inserting_before(first_body):
        probes = [copy.placeholder(f"probe_{k}") for k in range(len(nodes))]
    for node, probe in zip(nodes, probes, strict=True):
        with copy.inserting_after(node):
            probed = copy.call_function(operator.add, (node, probe))
        node.replace_all_uses_with(probed, delete_user_cb=lambda user, probed=probed: user is not probed)
    output = next(n for n in copy.nodes if n.op == "output")
    result = output.args[0]
    copy.erase_node(output)
    copy.output((result, tuple(tuple(node.args) for node in nodes)))
    copy.lint()
    return fx.GraphModule(model, copy)
