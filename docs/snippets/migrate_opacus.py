"""The adaclip side of the Opacus migration guide (Opacus itself is not needed)."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import adaclip_torch

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(512, 20), torch.randint(0, 3, (512,)))
EPOCHS = 2

# --8<-- [start:epsilon]
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(dataset, batch_size=64)

model, optimizer, data_loader = adaclip_torch.make_private_with_epsilon(
    module=model, optimizer=optimizer, data_loader=data_loader,
    target_epsilon=3.0, target_delta=1e-5, epochs=EPOCHS, max_grad_norm=1.0,
)  # flat clipping (DP-SGD, as in Opacus) is the default; strategy="adaclip" for AdaCliP
criterion = nn.CrossEntropyLoss()
for _ in range(EPOCHS):
    for x, y in data_loader:
        optimizer.zero_grad()
        criterion(model(x), y).backward()
        optimizer.step()
print("epsilon:", optimizer.get_epsilon(1e-5))
# --8<-- [end:epsilon]
assert isinstance(optimizer, adaclip_torch.FlatClip)
assert optimizer.get_epsilon(1e-5) <= 3.0

# --8<-- [start:sigma]
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data_loader = DataLoader(dataset, batch_size=64)

model, optimizer, data_loader = adaclip_torch.make_private(
    module=model, optimizer=optimizer, data_loader=data_loader,
    noise_multiplier=1.1, max_grad_norm=1.0,  # Poisson sampling, always
    accountant="prv",  # Opacus's default accountant (computed as "pld"); adaclip's default is "rdp"
)
# --8<-- [end:sigma]
for x, y in data_loader:
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
print("epsilon:", optimizer.get_epsilon(1e-5))

# --8<-- [start:by-hand]
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
q = 64 / len(dataset)
optimizer = adaclip_torch.FlatClip(
    torch.optim.SGD(model.parameters(), lr=0.1), model,
    max_grad_norm=1.0, noise_multiplier=1.1, expected_batch_size=q * len(dataset))
data_loader = adaclip_torch.poisson_data_loader(dataset, q)
# --8<-- [end:by-hand]
for x, y in data_loader:
    optimizer.zero_grad()
    criterion(model(x), y).backward()
    optimizer.step()
