"""Fixed- and clipped-denominator estimators of a weighted average over sampled users."""
import numpy as np

from adaclip.estimators import (
    capped_user_weights,
    clipped_denominator_estimate,
    clipped_denominator_sensitivity,
    fixed_denominator_estimate,
    fixed_denominator_sensitivity,
)

rng = np.random.default_rng(0)
examples_per_user = rng.integers(1, 200, size=1000)           # n_k for all U users
w = capped_user_weights(examples_per_user, weight_cap=100)   # w_k = min(n_k/ŵ, 1)
W, q, S = w.sum(), 0.05, 1.0                                  # total weight, rate, clip norm

sampled = rng.random(1000) < q
deltas = rng.standard_normal((1000, 4))
deltas *= np.minimum(1.0, S / np.linalg.norm(deltas, axis=1, keepdims=True))  # ‖Δ_k‖ <= S
weighted_sum = (w[sampled, None] * deltas[sampled]).sum(axis=0)

f_f = fixed_denominator_estimate(weighted_sum, sample_rate=q, total_weight=W)
f_c = clipped_denominator_estimate(weighted_sum, w[sampled].sum(), sample_rate=q,
                                   min_total_weight=0.5 * W)
print("sensitivities:",
      fixed_denominator_sensitivity(clip_norm=S, sample_rate=q, total_weight=W),
      clipped_denominator_sensitivity(clip_norm=S, sample_rate=q, min_total_weight=0.5 * W))
sigma = 1.0
noisy_f = f_f + sigma * fixed_denominator_sensitivity(clip_norm=S, sample_rate=q, total_weight=W) \
    * rng.standard_normal(4)
print("noisy fixed-denominator estimate:", np.round(noisy_f, 4))
