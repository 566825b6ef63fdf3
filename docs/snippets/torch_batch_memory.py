"""Opacus's BatchMemoryManager loop: logical Poisson batches of 64 on average, physical batches of
at most 16, one release (and one accounted step) per logical batch."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import adaclip_torch
from adaclip_torch import BatchMemoryManager

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(512, 20), torch.randint(0, 3, (512,)))
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
criterion = nn.CrossEntropyLoss()
model, optimizer, data_loader = adaclip_torch.make_private(
    module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    data_loader=DataLoader(dataset, batch_size=64),  # the LOGICAL batch: q = 64/512
    noise_multiplier=1.1, max_grad_norm=1.0,
)

# --8<-- [start:loop]
with BatchMemoryManager(data_loader=data_loader, max_physical_batch_size=16,
                        optimizer=optimizer) as physical_loader:
    for x, y in physical_loader:          # at most 16 examples each
        optimizer.zero_grad()             # keeps the logical batch's pending sum
        criterion(model(x), y).backward()
        optimizer.step()                  # accumulates, or releases on the last physical batch
print("released steps:", optimizer.steps, "epsilon:", optimizer.get_epsilon(1e-5))
# --8<-- [end:loop]
assert optimizer.steps == optimizer.accountant.steps == 8  # round(1/q) logical batches
