"""make_private: calibrate σ for (ε, δ), Poisson-sample the data, attach an accountant."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from adaclip_torch import make_private

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(512, 20), torch.randint(0, 3, (512,)))
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loader = DataLoader(dataset, batch_size=64)  # batch_size sets q = 64/512

model, optimizer, loader = make_private(
    model, optimizer, loader,
    target_epsilon=3.0, delta=1e-5, epochs=2,
    strategy="adaclip", std_min=1e-3, std_max=1.0,  # strategy keywords pass through
    seed=0,  # experiments only; leave it out (or use secure_mode=True) in deployment
)
criterion = nn.CrossEntropyLoss()
for _ in range(2):
    for x, y in loader:        # Poisson batches: random size, possibly empty
        criterion(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

sigma = optimizer.hyperparameters().noise_multiplier
print(f"sigma = {sigma:.3f}, steps = {optimizer.steps}, "
      f"epsilon = {optimizer.accountant.epsilon(1e-5):.3f} (budget 3.0)")
assert optimizer.accountant.epsilon(1e-5) <= 3.0
