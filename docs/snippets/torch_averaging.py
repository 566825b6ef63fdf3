"""An EMA of the parameters, attached to a private optimizer; evaluate and save the average."""
import io

import torch
from torch import nn

from adaclip_torch import FlatClip, ParameterAverage

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 3))
optimizer = FlatClip(torch.optim.SGD(model.parameters(), lr=0.1), model,
                     max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=32, seed=0)
steps = 50
avg = ParameterAverage(model, kind="ema", total_steps=steps)   # H = default_horizon(50) = 10
avg.attach(optimizer)      # hooks the wrapped SGD: one update per private step

x_val, y_val = torch.randn(64, 20), torch.randint(0, 3, (64,))
for _ in range(steps):
    x, y = torch.randn(32, 20), torch.randint(0, 3, (32,))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
assert avg.count == steps

live = [p.detach().clone() for p in model.parameters()]
with avg.averaged():       # the averaged values are in the model here ...
    val_loss = nn.functional.cross_entropy(model(x_val), y_val).item()
    averaged_weights = io.BytesIO()
    torch.save(model.state_dict(), averaged_weights)
assert all(torch.equal(p, q) for p, q in zip(model.parameters(), live))   # ... and not after

checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "average": avg.state_dict()}        # resume: avg.load_state_dict(checkpoint["average"])
print(avg, f"| validation loss of the average {val_loss:.3f}")
