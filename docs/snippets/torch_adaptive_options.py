"""The adaptive options from the one-line wrapper, and the diagnostic (tiny random data)."""
import torch
from torch import nn

from adaclip.diagnostics import format_scale_report, scale_report
from adaclip.strategies import QuantileRule
from adaclip_torch import AdaClip, AutomaticClip, QuantileClip

torch.manual_seed(0)
criterion = nn.CrossEntropyLoss()


def train(make_optimizer, steps=20):
    model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = make_optimizer(model)
    for _ in range(steps):
        x, y = torch.randn(64, 20), torch.randint(0, 3, (64,))
        criterion(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


mechanism = dict(noise_multiplier=1.0, expected_batch_size=64, seed=0)

# Separated scale: the statistics set only the shape (pooled per tensor, noise removed after
# averaging); the clip level starts at C = 1 and follows the median unit norm (quantile rule,
# whose count release is folded into σ); the centre is a Kalman filter on the releases.
adaptive = train(lambda model: AdaClip(
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
    scale="separated", max_grad_norm=1.0, pooling="tensor", correction="unbiased",
    centre="kalman", quantile=QuantileRule(target_quantile=0.5, count_noise_multiplier=3.2),
    **mechanism))
print(format_scale_report(scale_report(adaptive.strategy, adaptive.clip_state,
                                       names=adaptive.param_names)))
print("clip level C_t:", float(adaptive.clip_state.extra["clip_norm"]))

# The practitioner baselines in the same family.
quantile = train(lambda model: QuantileClip(
    torch.optim.SGD(model.parameters(), lr=0.1), model, max_grad_norm=1.0,
    count_noise_multiplier=3.2, **mechanism))
automatic = train(lambda model: AutomaticClip(
    torch.optim.SGD(model.parameters(), lr=0.1), model, **mechanism))
print("steps:", adaptive.steps, quantile.steps, automatic.steps)
