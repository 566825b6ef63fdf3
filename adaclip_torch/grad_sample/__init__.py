"""Per-sample (per-example) gradients for PyTorch models, computed with module hooks.

Contract (what :mod:`adaclip_torch`'s optimizer wrapper relies on)::

    from adaclip_torch.grad_sample import GradSampleHooks
    hooks = GradSampleHooks(model, loss_reduction="mean", batch_first=True)
    loss = criterion(model(x), y); loss.backward()
    p.grad_sample   # for every p in model.parameters() with p.requires_grad: shape (n, *p.shape)
    hooks.clear()   # delete every p.grad_sample (call between batches)
    hooks.remove()  # detach all hooks (and clear); the model is as before
    hooks.batch_size  # n of the last backward pass (0 if none)

- ``p.grad_sample[i]`` is the gradient of example i's loss alone, ∂ℓ_i/∂p — NOT divided by n:
  with ``loss_reduction="mean"`` (loss = (1/n) Σ_i ℓ_i) the engine multiplies the captured
  gradients back by n; with ``"sum"`` (loss = Σ_i ℓ_i) it uses them as they are. Hence
  ``p.grad_sample.sum(0)`` equals ``p.grad`` (``"sum"``) or ``n · p.grad`` (``"mean"``).
  Modules on the ghost path (``capture_only``) keep the output gradient as autograd gave it,
  with the factor ``s`` (``n`` or 1) beside it; their ghost forms apply ``s`` to their results.
- It is summed over every use of ``p`` in the forward pass: a module called several times, or a
  weight shared by several modules (tied embedding and softmax weights) gets the sum of all
  contributions, per example.
- Frozen parameters (``requires_grad=False``) get no ``grad_sample``. A missing (or ``None``)
  ``grad_sample`` after a backward pass means none was computed.
- Several backward passes before ``clear()`` accumulate (sum) per example if their batch
  sizes agree; otherwise :class:`adaclip.errors.InvalidGradientError` is raised from
  ``backward()``.
- Batch dimension: dim 0 of module inputs (``batch_first=True``) or dim 1 (``False``); conv and
  GroupNorm always dim 0; ``nn.LSTM``/``nn.GRU``/``nn.RNN`` follow their own ``batch_first``.
- Inputs that do not carry the batch (``batch_first=True``): a module called on a tensor that
  does not descend from the model call's batched inputs — an index built in ``forward``
  (``torch.arange(L)``, an ``(L, L)`` relative-position matrix), a buffer, a parameter — whatever
  its shape (also when its dim 0 equals the batch size by chance: :mod:`._provenance` tracks
  where each tensor of the forward pass comes from), a module fed by such a call or without
  tensor inputs, and any module declared with :func:`mark_batch_free` gets example i's gradient
  routed through the shared input — its output's gradient is taken where the output is
  broadcast against the batch (:mod:`.batch_free`, with the maths and the privacy argument). What
  cannot be routed is refused with :class:`adaclip.errors.InvalidGradientError` naming the module.
- FSDP2 (``fully_shard``): the modules' parameters are sharded DTensors, swapped for unsharded
  copies around forward and backward; ``grad_sample`` is the per-example gradient of the *full*
  parameter (this rank's examples) and is stored on the sharded DTensor parameter (whose
  ``shape`` is the full one), a plain tensor of shape ``(n, *p.shape)``. A module that
  ``fully_shard`` re-classed (``FSDPLinear``, ...) keeps its original type's rule.
- Empty batch (n = 0): if torch's forward/backward run on it (Linear, Embedding, Conv, norms,
  ``nn.LSTM``, DPLSTM and the fallback do), every ``grad_sample`` has shape ``(0, *p.shape)``;
  if some module's forward rejects an empty batch, torch's error surfaces from the forward pass
  and no per-sample gradient exists.

How it is computed: exact rules for ``nn.Linear``, ``nn.Embedding``, ``nn.Conv1d``,
``nn.Conv2d``, ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm`` and ``transformers``'
``Conv1D`` (:mod:`.hf`; one module per layer type, registered with
:func:`register_grad_sampler`), and a :mod:`torch.func` fallback (vmap of per-example VJPs, or a
per-example loop where vmap cannot run, e.g. ``nn.LSTM``/``nn.GRU``) for any other module that
owns parameters (a module without a rule that also has parameter-owning descendants — e.g.
``nn.MultiheadAttention``, which reads ``out_proj.weight`` without calling ``out_proj`` — is
handled over its whole subtree). ``BatchNorm`` (mixes examples),
``nn.Embedding(scale_grad_by_freq=True)`` and internal dropout of ``nn.LSTM``/``nn.GRU``/
``nn.MultiheadAttention`` in training mode (the fallback re-runs the forward) are rejected with
:class:`adaclip.errors.InvalidHyperparameterError`. For LSTM language models prefer
:class:`adaclip_torch.layers.DPLSTM` (same function as ``nn.LSTM``, built from linear layers,
batched per-sample gradients — about 10× faster than the per-example loop ``nn.LSTM`` needs).

Limitations:

- A parameter must be used through the forward of its own module (or of a fallback module
  above it). A weight read directly by *another* module's code (``F.linear(h, self.emb.weight)``
  in a parent that owns no parameters) is invisible to the hooks and its ``grad_sample`` misses
  that use — tie weights by assignment (``out.weight = emb.weight``) and call ``out``.
- Rules are looked up by exact type when the hooks are attached; submodules added later are
  not hooked. Subclasses of ruled layers go to the fallback (their ``forward`` may differ).
- The fallback assumes the module treats examples independently and deterministically, with
  every tensor input/output batched on the batch dimension (see
  :func:`functorch_fallback.fallback_batch_dims`); ``PackedSequence`` inputs are rejected.
- Activation checkpointing (which re-runs forwards during backward) is untested.
"""

from __future__ import annotations

from . import conv, embedding, linear, normalization  # noqa: F401  (register the built-in rules)
from .batch_free import BatchFreeTensor, mark_batch_free
from .functorch_fallback import fallback_grad_sample
from .hooks import LOSS_REDUCTIONS, GradSampleHooks
from .registry import GRAD_SAMPLERS, GradSampleRule, get_grad_sampler, register_grad_sampler

__all__ = [
    "BatchFreeTensor",
    "GradSampleHooks",
    "mark_batch_free",
    "LOSS_REDUCTIONS",
    "register_grad_sampler",
    "get_grad_sampler",
    "GradSampleRule",
    "GRAD_SAMPLERS",
    "fallback_grad_sample",
]
