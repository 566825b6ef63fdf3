"""Banded correlated noise with make_private: cyclic Poisson batches, σ for ⌈T/b⌉ compositions.

make_private chooses the number of bands b before training (from ε, δ, q and the run length
only), builds the cyclic Poisson loader and calibrates σ; b = 1 would be DP-SGD.
"""
import io

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adaclip_torch import make_private

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(1000, 20), torch.randint(0, 3, (1000,)))
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer, loader = make_private(
    model, optimizer, DataLoader(dataset, batch_size=50),
    target_epsilon=3.0, delta=1e-5, epochs=3,
    noise_mechanism="banded",  # bands=None: chosen before training; or bands=8
    averaging="ema",           # evaluate the average of the last 10 % of the run
    seed=0,                    # experiments only
)
criterion = nn.CrossEntropyLoss()
for _ in range(3):
    for x, y in loader:  # every batch, empty ones included, is one step
        criterion(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
b = loader.batch_sampler.bands
print(f"bands = {b}, sigma = {optimizer.hyperparameters().noise_multiplier:.3f}, "
      f"steps = {optimizer.steps}, accounted compositions = {optimizer.accountant.steps} "
      f"at rate {optimizer.accounted_sample_rate:.3f}, epsilon = {optimizer.accountant.epsilon(1e-5):.3f}")
assert optimizer.accountant.epsilon(1e-5) <= 3.0
with optimizer.averaged():  # the averaged parameters, for evaluation or saving
    torch.save(model.state_dict(), io.BytesIO())
