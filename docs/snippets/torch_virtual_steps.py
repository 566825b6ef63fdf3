"""Virtual steps: a logical batch of 256 from physical batches of 64, one noise draw."""
import torch
from torch import nn

from adaclip_torch import AdaClip

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model,
                    noise_multiplier=1.0, expected_batch_size=256,  # the LOGICAL size
                    seed=0)
criterion = nn.CrossEntropyLoss()

for _ in range(3):
    for micro in range(4):
        x, y = torch.randn(64, 20), torch.randint(0, 3, (64,))
        criterion(model(x), y).backward()
        if micro < 3:
            optimizer.accumulate()   # clip and add to a buffer; releases nothing
        else:
            optimizer.step()         # adds this batch, noises once, steps
            optimizer.zero_grad()
print("released steps:", optimizer.steps)  # 3, not 12
