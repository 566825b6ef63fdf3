"""make_private: Poisson-sample the data, wrap the optimizer, attach an accountant.

Two ways, as in Opacus: a noise multiplier used as given, or a target (ε, δ) for which σ is
calibrated.
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adaclip_torch import make_private

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(512, 20), torch.randint(0, 3, (512,)))
criterion = nn.CrossEntropyLoss()


def train(model, optimizer, loader, epochs):
    for _ in range(epochs):
        for x, y in loader:        # Poisson batches: random size, possibly empty
            criterion(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()


# 1. From a target (ε, δ): σ is the smallest noise multiplier that keeps `epochs` epochs
#    within the budget, and the accountant refuses any step beyond it.
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loader = DataLoader(dataset, batch_size=64)  # batch_size sets q = 64/512
model, optimizer, loader = make_private(
    model, optimizer, loader,
    target_epsilon=3.0, delta=1e-5, epochs=2,  # delta= or Opacus's target_delta=
    max_grad_norm=1.0,  # flat clipping (the default strategy) at this clip norm
    seed=0,  # experiments only; leave it out (or use secure_mode=True) in deployment
)
train(model, optimizer, loader, epochs=2)
sigma = optimizer.hyperparameters().noise_multiplier
print(f"sigma = {sigma:.3f}, steps = {optimizer.steps}, "
      f"epsilon = {optimizer.accountant.epsilon(1e-5):.3f} (budget 3.0)")
assert optimizer.accountant.epsilon(1e-5) <= 3.0

# 2. From a noise multiplier, as Opacus's make_private(noise_multiplier=, max_grad_norm=):
#    σ is used as given and the accountant only records the steps.
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer, loader = make_private(
    model, optimizer, DataLoader(dataset, batch_size=64),
    noise_multiplier=1.1, max_grad_norm=1.0,
    strategy="adaclip",  # AdaCliP's centred preset, started at max_grad_norm; its keywords pass through
    seed=0,
)
train(model, optimizer, loader, epochs=2)
print(f"steps = {optimizer.steps}, epsilon(1e-5) = {optimizer.accountant.epsilon(1e-5):.3f}")
