"""Wrap an existing torch.optim optimizer in one line (tiny random data)."""
import torch
from torch import nn

from adaclip_torch import AdaClip

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
criterion = nn.CrossEntropyLoss()  # reduction="mean", matching loss_reduction="mean"

# The only new line: wrap the optimizer you already have.
optimizer = AdaClip(torch.optim.Adam(model.parameters(), lr=1e-3), model,
                    noise_multiplier=1.1, expected_batch_size=32, seed=0)
# DP-SGD instead: FlatClip(torch.optim.Adam(...), model, max_grad_norm=1.0,
#                          noise_multiplier=1.1, expected_batch_size=32)

for _ in range(5):
    x, y = torch.randn(32, 20), torch.randint(0, 3, (32,))
    loss = criterion(model(x), y)
    loss.backward()        # the hooks keep what the per-example norms need (ghost norms for Linear)
    optimizer.step()       # clip, noise once, rescale, then Adam steps on the result
    optimizer.zero_grad()  # clears p.grad and the per-example state

print("private steps taken:", optimizer.steps)
print("AdaCliP std estimates stay in [std_min, std_max]:",
      min(float(s.min()) for s in optimizer.clip_state.std) >= 1e-5)
