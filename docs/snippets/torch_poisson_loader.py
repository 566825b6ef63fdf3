"""The pieces make_private assembles, by hand: Poisson loader, accountant, wrapper."""
import torch
from torch import nn
from torch.utils.data import TensorDataset

from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip_torch import FlatClip, poisson_data_loader

torch.manual_seed(0)
N, epochs = 1000, 2
dataset = TensorDataset(torch.randn(N, 20), torch.randint(0, 3, (N,)))
q = 50 / N                                   # sample rate
steps_per_epoch = round(1 / q)               # 20
sigma = calibrate_noise_multiplier(target_epsilon=2.0, delta=1e-5, sample_rate=q,
                                   steps=epochs * steps_per_epoch)
accountant = Accountant(target_epsilon=2.0, delta=1e-5)

loader = poisson_data_loader(dataset, q, num_steps=steps_per_epoch,
                             generator=torch.Generator().manual_seed(1))
model = nn.Linear(20, 3)
optimizer = FlatClip(torch.optim.SGD(model.parameters(), lr=0.5), model,
                     max_grad_norm=1.0, noise_multiplier=sigma,
                     expected_batch_size=q * N,   # B̄ = 50, never len(x)
                     accountant=accountant, sample_rate=q)

sizes = []
for _ in range(epochs):
    for x, y in loader:
        sizes.append(len(x))
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
print("realised batch sizes:", sizes[:8], "...")
print(f"epsilon after {accountant.steps} steps: {accountant.epsilon():.3f}")
