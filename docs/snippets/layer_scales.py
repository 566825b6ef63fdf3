"""eDP-SGD layer scales: from public data (free) or from a private, accounted release."""
import numpy as np

from adaclip import ScaledClipping
from adaclip.accounting import Accountant
from adaclip.layer_scales import layer_scales_from_public, private_layer_scales

rng = np.random.default_rng(0)
shapes = [(64, 10), (10,)]
public = [rng.standard_normal((32, *s)) * w for s, w in zip(shapes, (0.05, 0.5))]
alphas = layer_scales_from_public(public)          # RMS-normalised: sqrt(mean α²) = 1
print("public scales:", np.round(alphas, 3))

private = [rng.standard_normal((64, *s)) * w for s, w in zip(shapes, (0.05, 0.5))]
accountant = Accountant(target_epsilon=3.0, delta=1e-5)
alphas_dp = private_layer_scales(private, noise_multiplier=2.0, expected_batch_size=64,
                                 clip_norm=5.0, accountant=accountant, sample_rate=64 / 1000,
                                 rng=np.random.default_rng(1))
print("private scales:", np.round(alphas_dp, 3), "| recorded steps:", accountant.steps)

strategy = ScaledClipping(max_grad_norm=1.0, layer_scales=alphas_dp)
