"""Secure mode: noise from the OS CSPRNG, several normals summed per coordinate."""
import torch
from torch import nn

from adaclip_torch import AdaClip

model = nn.Linear(20, 3)
optimizer = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model,
                    noise_multiplier=1.0, expected_batch_size=32,
                    secure_mode=True)          # no seed: it would be refused
x, y = torch.randn(32, 20), torch.randint(0, 3, (32,))
nn.functional.cross_entropy(model(x), y).backward()
optimizer.step()
optimizer.zero_grad()
print("secure mode:", optimizer.noise_source.secure_mode,
      "| noise state saved:", sorted(optimizer.state_dict()["noise"]))
