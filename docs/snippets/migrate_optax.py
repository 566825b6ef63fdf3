"""optax.contrib.differentially_private_aggregate next to adaclip_jax.flat_clip.

With σ = 0 and expected_batch_size equal to the realised batch size the two coincide; they
differ in the denominator once batches are Poisson-sampled (optax: realised n; adaclip: B̄)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import adaclip_jax

params = {"w": jnp.ones((5, 3)), "b": jnp.zeros(3)}
per_example = jax.tree.map(
    lambda p: jax.random.normal(jax.random.key(0), (16, *p.shape)), params)

theirs = optax.contrib.differentially_private_aggregate(
    l2_norm_clip=1.0, noise_multiplier=0.0, key=jax.random.key(0))
ours = adaclip_jax.flat_clip(max_grad_norm=1.0, noise_multiplier=0.0,
                             expected_batch_size=16, key=jax.random.key(0))
u_theirs, _ = theirs.update(per_example, theirs.init(params), params)
u_ours, _ = ours.update(per_example, ours.init(params), params)
for a, b in zip(jax.tree.leaves(u_theirs), jax.tree.leaves(u_ours)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
print("same clipped mean for sigma = 0, n = expected_batch_size")

# A Poisson batch of 12 rows with B̄ = 16: optax would divide by 12, adaclip divides by 16.
mask = jnp.arange(16) < 12
u_masked, _ = ours.update(per_example, ours.init(params), params, unit_mask=mask)
