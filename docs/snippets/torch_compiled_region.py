"""A small CNN trained privately with its per-example gradients compiled (torch.compile)."""
import torch
from sklearn.datasets import load_digits
from torch import nn

from adaclip_torch import make_private
from adaclip_torch.compiled import CompiledPerExampleGradients

torch.manual_seed(0)
digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (1797, 1, 8, 8)
y = torch.tensor(digits.target)
train = torch.utils.data.TensorDataset(x[:1500], y[:1500])
model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))

model, optimizer, loader = make_private(
    model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
    torch.utils.data.DataLoader(train, batch_size=100),
    target_epsilon=3.0, delta=1e-5, epochs=5,
    attach_hooks=False,              # the region, not the hooks, gives the per-example gradients
)
# one compiled function: vmap over the batch of one example's gradient (Poisson batches are
# padded to a multiple of 32 rows, so a few sizes compile, not every one)
per_example = CompiledPerExampleGradients(optimizer, nn.functional.cross_entropy)

for _epoch in range(5):
    for xb, yb in loader:
        if len(xb) == 0:
            optimizer.step(empty_batch=True)  # a Poisson batch can be empty: still a private step
            continue
        loss = per_example(xb, yb)           # sets p.grad_sample for every trainable parameter
        optimizer.step()                     # clip, noise, rescale, account: as with the hooks
        optimizer.zero_grad()

with torch.no_grad():
    accuracy = (model(x[1500:]).argmax(1) == y[1500:]).float().mean().item()
print(f"test accuracy {accuracy:.3f} at epsilon {optimizer.get_epsilon(1e-5):.2f}")
