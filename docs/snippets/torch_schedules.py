"""A noise-decay schedule and an LR scheduler on the wrapper; the accountant sees every σ_t."""
import torch
from torch import nn

from adaclip.accounting import Accountant
from adaclip.schedules import ExponentialNoiseDecay
from adaclip_torch import AdaClip

torch.manual_seed(0)
model = nn.Linear(20, 3)
accountant = Accountant("rdp")  # RDP: a decaying σ makes many different steps, which RDP composes fastest
optimizer = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model,
                    noise_schedule=ExponentialNoiseDecay(initial_noise_multiplier=1.5,
                                                         decay_rate=0.1, steps_per_epoch=4),
                    expected_batch_size=32, accountant=accountant, sample_rate=32 / 1000,
                    seed=0)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)

for _ in range(12):
    x, y = torch.randn(32, 20), torch.randint(0, 3, (32,))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
print("lr now:", optimizer.param_groups[0]["lr"])
print("runs (q, sigma, count):", [(round(q, 3), round(s, 3), c) for q, s, c in accountant.history])
