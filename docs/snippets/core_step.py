"""The framework-agnostic core on NumPy: one private step of any strategy."""
import numpy as np

from adaclip import AdaptiveClipping, FlatClipping, private_step
from adaclip.accounting import Accountant
from adaclip.transform import check_per_example_grads

rng = np.random.default_rng(0)
params = [np.zeros((64, 10)), np.zeros(10)]               # two parameter tensors
N, q = 1000, 0.05
strategy = AdaptiveClipping(std_min=1e-3, std_max=0.1, beta_mean=0.99, beta_std=0.999)
state = strategy.init(params)   # m = 0, s = sqrt(std_min·std_max) per coordinate
accountant = Accountant(target_epsilon=3.0, delta=1e-5)

for _ in range(3):
    n = rng.binomial(N, q)                                 # Poisson batch size
    grads = [rng.standard_normal((n, *p.shape)) * 0.01 for p in params]
    check_per_example_grads(grads, [p.shape for p in params], allow_empty=True)
    noise = [rng.standard_normal(p.shape) for p in params]  # z ~ N(0, I); σ applied inside
    accountant.step(noise_multiplier=1.1, sample_rate=q)    # refuses before overspending
    noisy, state = private_step(strategy, state, grads, noise,
                                noise_multiplier=1.1, expected_batch_size=q * N)
    params = [p - 0.1 * g for p, g in zip(params, noisy)]

print("steps:", state.step, "| epsilon:", round(accountant.epsilon(), 3))

# Flat clipping goes through the same function; it has no state beyond the step counter.
flat = FlatClipping(max_grad_norm=1.0)
noisy, _ = private_step(flat, flat.init(params), grads, noise,
                        noise_multiplier=1.1, expected_batch_size=q * N)
