"""Checkpoint and resume bit for bit: optimizer.state_dict() holds the wrapped optimizer,
the AdaCliP moments, the noise generator and the accountant; the sampler has its own."""
import io

import torch
from torch import nn
from torch.utils.data import TensorDataset

from adaclip.accounting import Accountant
from adaclip_torch import AdaClip, poisson_data_loader

N, q = 400, 0.1
dataset = TensorDataset(torch.randn(N, 10, generator=torch.Generator().manual_seed(0)),
                        torch.randint(0, 2, (N,), generator=torch.Generator().manual_seed(1)))


def build():
    torch.manual_seed(0)
    model = nn.Linear(10, 2)
    opt = AdaClip(torch.optim.Adam(model.parameters(), lr=1e-2), model,
                  noise_multiplier=1.0, expected_batch_size=q * N, seed=0,
                  accountant=Accountant("rdp"), sample_rate=q)
    loader = poisson_data_loader(dataset, q, generator=torch.Generator().manual_seed(2))
    return model, opt, loader


def train(model, opt, loader, num_steps):
    batches = iter(loader)
    for _ in range(num_steps):
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


# Uninterrupted: 6 steps.
model_a, opt_a, loader_a = build()
train(model_a, opt_a, loader_a, 6)

# Interrupted: 3 steps, save, rebuild everything, load, 3 more steps.
model_b, opt_b, loader_b = build()
train(model_b, opt_b, loader_b, 3)
buffer = io.BytesIO()
torch.save({"model": model_b.state_dict(), "optimizer": opt_b.state_dict(),
            "sampler": loader_b.batch_sampler.state_dict()}, buffer)

model_c, opt_c, loader_c = build()
buffer.seek(0)
ckpt = torch.load(buffer, weights_only=False)
model_c.load_state_dict(ckpt["model"])
opt_c.load_state_dict(ckpt["optimizer"])
loader_c.batch_sampler.load_state_dict(ckpt["sampler"])
train(model_c, opt_c, loader_c, 3)

for pa, pc in zip(model_a.parameters(), model_c.parameters()):
    assert torch.equal(pa, pc)
assert opt_a.accountant.epsilon(1e-5) == opt_c.accountant.epsilon(1e-5)
print("resumed run == uninterrupted run, bit for bit; steps:", opt_c.steps)
