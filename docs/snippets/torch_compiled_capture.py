"""An MLP trained privately under torch.compile with ghost clipping: the capture region."""
import torch
from sklearn.datasets import load_digits
from torch import nn

from adaclip_torch import make_private
from adaclip_torch.compiled import CompiledPerExampleGradients

torch.manual_seed(0)
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # (1797, 64)
y = torch.tensor(digits.target)
train = torch.utils.data.TensorDataset(x[:1500], y[:1500])
model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.LayerNorm(128), nn.Linear(128, 10))

model, optimizer, loader = make_private(
    model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
    torch.utils.data.DataLoader(train, batch_size=100),
    target_epsilon=3.0, delta=1e-5, epochs=5,   # the hooks stay attached: they receive the captures
)
# one compiled function: the model traced with torch.fx, every layer call's input and output
# gradient from one forward and one backward; the ghost engine clips the Linear layers from
# them without forming per-example gradients, the LayerNorm's rule forms its own
per_example = CompiledPerExampleGradients(optimizer, nn.functional.cross_entropy, method="capture")

for _epoch in range(5):
    for xb, yb in loader:
        if len(xb) == 0:
            optimizer.step(empty_batch=True)  # a Poisson batch can be empty: still a private step
            continue
        loss = per_example(xb, yb)           # hands the hooks what loss.backward() would
        optimizer.step()                     # clip, noise, rescale, account: as with the hooks
        optimizer.zero_grad()

with torch.no_grad():
    accuracy = (model(x[1500:]).argmax(1) == y[1500:]).float().mean().item()
print(f"test accuracy {accuracy:.3f} at epsilon {optimizer.get_epsilon(1e-5):.2f}")
