"""Restoring a checkpoint without replaying the noise: refresh_key (seeded mode) or secure_mode."""
import os
import pickle
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaclip_jax

params = {"w": jnp.zeros((20, 3))}
per_example = {"w": jax.random.normal(jax.random.key(1), (8, 20, 3))}   # 8 units

# Seeded mode: reproducible, and the key in opt_state is a secret.
private = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0,
                                expected_batch_size=8, key=jax.random.key(0))
tx = optax.chain(private, optax.sgd(0.1))
opt_state = tx.init(params)
checkpoint = pickle.dumps(jax.device_get(opt_state))      # save (keep it as secret as the key)

first, _ = tx.update(per_example, opt_state, params)      # released after the checkpoint
restored = pickle.loads(checkpoint)
replayed, _ = tx.update(per_example, restored, params)
print("restored key replays the noise:", bool(np.allclose(first["w"], replayed["w"])))

restored = adaclip_jax.refresh_key(pickle.loads(checkpoint))   # a fresh key from the OS
fresh, _ = tx.update(per_example, restored, params)
print("after refresh_key:", bool(np.allclose(first["w"], fresh["w"])))

# np.savez: keys as their key data (state_to_numpy), back with the init state as a template.
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "opt_state.npz")
    np.savez(path, *jax.tree_util.tree_leaves(adaclip_jax.state_to_numpy(opt_state)))
    with np.load(path) as saved:
        leaves = [saved[f"arr_{i}"] for i in range(len(saved.files))]
template = tx.init(params)
arrays = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)
# strategy=: the restored clipping state is checked (shapes, finite, in range) before use
restored = adaclip_jax.refresh_key(adaclip_jax.state_from_numpy(arrays, template, strategy=private.strategy))
fresh, _ = tx.update(per_example, restored, params)
print("np.savez round trip, then refresh_key:", bool(np.allclose(first["w"], fresh["w"])))

# Secure mode: fresh OS bits in every step's noise; no key needed, nothing to refresh.
secure = optax.chain(adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=1.0,
                                           expected_batch_size=8, secure_mode=True),
                     optax.sgd(0.1))
state = secure.init(params)
step = jax.jit(secure.update)
a, _ = step(per_example, state, params)
b, _ = step(per_example, state, params)                   # the same state twice
print("secure mode, same state twice:", bool(np.allclose(a["w"], b["w"])))
