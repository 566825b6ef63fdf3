"""The NumPy reference (flat vectors) agrees with the array-API core on injected noise."""
import numpy as np

from adaclip import AdaptiveClipping, private_step
from adaclip.reference import adaclip_step

rng = np.random.default_rng(0)
d, n = 12, 5
g = rng.standard_normal((n, d))
z = rng.standard_normal(d)
s0 = np.sqrt(1e-3 * 1.0)
ref, m1, s1 = adaclip_step(g, np.zeros(d), np.full(d, s0), z, noise_multiplier=1.0,
                           expected_batch_size=8.0, std_min=1e-3, std_max=1.0)

strategy = AdaptiveClipping(std_min=1e-3, std_max=1.0)
# the same d coordinates split into two tensors (4 + 8): b couples them through Σ s
core, state = private_step(strategy, strategy.init([np.zeros(4), np.zeros(8)]),
                           [g[:, :4], g[:, 4:]], [z[:4], z[4:]],
                           noise_multiplier=1.0, expected_batch_size=8.0)
np.testing.assert_allclose(np.concatenate(core), ref, rtol=1e-12)
np.testing.assert_allclose(np.concatenate(state.std), s1, rtol=1e-12)
print("reference == core")
