"""adaclip_jax: AdaCliP and the affine clipping family as optax ``GradientTransformation``\\ s.

::

    import optax, adaclip_jax
    tx = adaclip_jax.private_chain(      # = optax.chain(private, *rest): the private one first
        adaclip_jax.adaclip(noise_multiplier=1.1, expected_batch_size=256, key=jax.random.key(0)),
        optax.adam(1e-3))
    opt_state = tx.init(params)
    per_example = adaclip_jax.per_example_grads(loss_fn)(params, batch)   # leading batch axis
    updates, opt_state = tx.update(per_example, opt_state, params)

**The private transformation comes first.** Any transformation before it reads the raw per-unit
gradients, which the mechanism has not privatised: its output and its state (Adam's moments, a
global-norm clip of the whole batch) depend on individual examples. :func:`private_chain` builds
the valid order; inside ``optax.chain``/``optax.named_chain`` the private transformation's
``init`` and ``update`` raise :class:`~adaclip.errors.InvalidHyperparameterError` when another
member runs before it; :func:`check_chain` / :func:`check_state_order` check an optimizer's state
structure (also catching wrappers such as ``optax.MultiSteps`` around it).

The maths is the framework-agnostic core (:mod:`adaclip.strategies`); this package adds the
optax plumbing, per-unit gradients, the accountant hook and data parallelism:

- :func:`adaclip` (with every option of :class:`adaclip.AdaptiveClipping`, and
  ``initial_max_grad_norm``), :func:`scale_then_privatize`, :func:`flat_clip`,
  :func:`per_layer_clip`, :func:`scaled_clip`, :func:`quantile_clip`, :func:`automatic_clip`:
  one implementation, :func:`private_aggregate`, parametrised by the core strategy; state
  :class:`AdaClipState`; :func:`with_public_statistics` (AdaCliP statistics from public data); ``update(..., noise_multiplier=σ_t, unit_mask=...)`` extra arguments;
  ``axis_name=`` for ``shard_map`` data parallelism (clip per device, ``psum``, noise once);
- :func:`per_example_grads` (``vmap(grad)``, micro-batching, user-level units via
  :func:`sum_by_unit`), :func:`clipped_sum_grads` (clip chunk by chunk, memory ``O(chunk·d)``);
  every per-example entry point refuses an argument outside ``batch_argnums`` (and
  ``shared_argnums``) that holds an array with the batch's leading size: every example would
  read all of it (e.g. every label);
- :func:`ghost_clipped_sum_grads` (:mod:`adaclip_jax.ghost`): the same clipped sum from ghost
  norms of Dense layers found in the jaxpr (no per-example gradients; other leaves fall back to
  ``vmap(grad)``), for every strategy (AdaCliP's centre and per-coordinate scale included);
  :func:`ghost_coverage` says which leaf takes which path;
- :func:`add_clipped_sums`: the clipped sums of several physical batches of one logical batch
  (large batches; ``optax.MultiSteps`` around the private transformation is refused);
- :func:`state_to_numpy` / :func:`state_from_numpy` (:mod:`adaclip_jax.checkpoint`): an
  optimizer state as NumPy arrays (PRNG keys as key data) for ``np.savez`` and back;
- an eager ``update`` call (outside ``jit``) runs compiled internally;
- :func:`private_chain`, :func:`check_chain`, :func:`check_state_order`: the chain order above;
- :func:`check_inputs`: eager validation (NaN/inf, shapes) before a jitted step, the opt-in
  debugging mode (under ``jit`` a unit with a NaN/inf gradient is dropped from the sum);
- ``secure_mode=True`` (fresh OS randomness in every step's noise) and :func:`refresh_key`
  (a new key for a restored seeded-mode state, so a checkpoint does not replay its noise);
- :class:`PrivacyTracker`: budget check, then the step with ``σ_t``, then one accountant record
  of the σ the returned state says was used;
- :func:`noise_schedule`: :mod:`adaclip.schedules` as a traceable ``step -> σ_t``.
- banded correlated noise (``noise_mechanism="banded", bands=b`` on every transformation; the
  buffers in ``AdaClipState.noise_buffers``): :func:`assign_groups` and
  :func:`cyclic_poisson_mask` (cyclic Poisson sampling as jittable masks), and
  :func:`padded_batch` with :func:`batch_buckets` (the sampled units' indices padded to a few
  fixed sizes: a jitted step on a batch, not on all ``N`` units),
  ``PrivacyTracker(..., bands=b)`` (``⌈T/b⌉`` compositions at rate ``b·q``).
- :func:`parameter_averaging` (pure, jittable ``init``/``update`` of an EMA or tail average of
  the parameters, :class:`AveragingState`), :func:`averaging_transformation` (the same as the
  last member of an optax chain) and :func:`averaged_params` (:mod:`adaclip_jax.averaging`).
"""

from adaclip_jax._aliases import (
    ReleaseOptions,
    adaclip,
    automatic_clip,
    flat_clip,
    per_layer_clip,
    private_aggregate,
    quantile_clip,
    scale_then_privatize,
    scaled_clip,
)
from adaclip_jax._chain import check_chain, check_state_order, private_chain
from adaclip_jax._grads import add_clipped_sums, clipped_sum_grads, per_example_grads, sum_by_unit
from adaclip_jax._keys import refresh_key
from adaclip_jax._sampling import assign_groups, batch_buckets, cyclic_poisson_mask, padded_batch
from adaclip_jax._schedules import noise_schedule
from adaclip_jax._state import AdaClipState, ClippedSum
from adaclip_jax._tracker import PrivacyTracker
from adaclip_jax._transform import PrivateTransformation, with_public_statistics
from adaclip_jax._validation import check_inputs
from adaclip_jax.averaging import (
    AveragingState,
    ParameterAveraging,
    averaged_params,
    averaging_transformation,
    parameter_averaging,
)
from adaclip_jax.checkpoint import state_from_numpy, state_to_numpy
from adaclip_jax.ghost import ghost_clipped_sum_grads, ghost_coverage
from adaclip_jax.sharding import noise_buffer_shardings, shard_noise_buffers

__all__ = [
    "AdaClipState",
    "AveragingState",
    "ClippedSum",
    "ParameterAveraging",
    "PrivacyTracker",
    "PrivateTransformation",
    "adaclip",
    "add_clipped_sums",
    "assign_groups",
    "automatic_clip",
    "averaged_params",
    "averaging_transformation",
    "batch_buckets",
    "check_chain",
    "check_inputs",
    "check_state_order",
    "clipped_sum_grads",
    "cyclic_poisson_mask",
    "flat_clip",
    "ghost_clipped_sum_grads",
    "ghost_coverage",
    "noise_buffer_shardings",
    "noise_schedule",
    "padded_batch",
    "parameter_averaging",
    "per_example_grads",
    "per_layer_clip",
    "private_aggregate",
    "ReleaseOptions",
    "private_chain",
    "quantile_clip",
    "refresh_key",
    "scale_then_privatize",
    "scaled_clip",
    "shard_noise_buffers",
    "state_from_numpy",
    "state_to_numpy",
    "sum_by_unit",
    "with_public_statistics",
]
