"""The fast path: ghost norms with a rank-one AdaCliP scale, and the release compiled."""

import torch
from sklearn.datasets import load_digits
from torch import nn

from adaclip_torch import AdaClip

x, y = load_digits(return_X_y=True)
x = torch.tensor(x / 16.0, dtype=torch.float32)  # a public, fixed rescaling
y = torch.tensor(y)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
optimizer = AdaClip(
    torch.optim.Adam(model.parameters(), lr=1e-3),
    model,
    noise_multiplier=1.0,
    expected_batch_size=256,
    scale="separated",  # the statistics set the shape, max_grad_norm the size
    max_grad_norm=1.0,
    pooling="factored",  # row × column statistics: a rank-one scale for every matrix
    centre="none",  # no centre term: Linear layers cost what flat clipping costs
    per_sample_mode="auto",  # ghost norms for Linear/Embedding layers
    compile_release=True,  # fuse the release's elementwise passes (compiles at the first steps)
)
print(type(optimizer.engine).__name__)  # GhostEngine
for _ in range(20):
    batch = torch.randint(0, len(x), (256,))
    loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"loss after {optimizer.steps} private steps: {loss.item():.3f}")
