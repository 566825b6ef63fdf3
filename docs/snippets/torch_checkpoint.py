"""Checkpoint and resume. Without a seed a restored optimizer draws fresh noise; with seed=
(experiments) the run resumes bit for bit, and the restore warns that the noise replays."""
import io
import warnings

import torch
from torch import nn
from torch.utils.data import TensorDataset

from adaclip.accounting import Accountant
from adaclip.errors import NoiseReplayWarning
from adaclip_torch import AdaClip, poisson_data_loader

N, q = 400, 0.1
dataset = TensorDataset(torch.randn(N, 10, generator=torch.Generator().manual_seed(0)),
                        torch.randint(0, 2, (N,), generator=torch.Generator().manual_seed(1)))


def build(seed=None):
    torch.manual_seed(0)
    model = nn.Linear(10, 2)
    opt = AdaClip(torch.optim.Adam(model.parameters(), lr=1e-2), model,
                  noise_multiplier=1.0, expected_batch_size=q * N, seed=seed,
                  accountant=Accountant(), sample_rate=q)
    loader = poisson_data_loader(dataset, q, generator=torch.Generator().manual_seed(2))
    return model, opt, loader


def train(model, opt, loader, num_steps):
    batches = iter(loader)
    for _ in range(num_steps):
        x, y = next(batches)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def save(model, opt, loader):
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "sampler": loader.batch_sampler.state_dict()}, buffer)
    buffer.seek(0)
    return buffer


def resume(buffer, seed=None):
    model, opt, loader = build(seed)
    ckpt = torch.load(buffer, weights_only=False)
    model.load_state_dict(ckpt["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NoiseReplayWarning)
        opt.load_state_dict(ckpt["optimizer"])
    loader.batch_sampler.load_state_dict(ckpt["sampler"])
    return model, opt, loader, [w.category.__name__ for w in caught]


# Seeded (experiments): 6 steps straight, or 3 + save + resume + 3: the same, bit for bit.
model_a, opt_a, loader_a = build(seed=0)
train(model_a, opt_a, loader_a, 6)
model_b, opt_b, loader_b = build(seed=0)
train(model_b, opt_b, loader_b, 3)
assert "generator_state" in opt_b.state_dict()["noise"]  # this checkpoint predicts the noise: secret
model_c, opt_c, loader_c, caught = resume(save(model_b, opt_b, loader_b), seed=0)
train(model_c, opt_c, loader_c, 3)
assert all(torch.equal(a, c) for a, c in zip(model_a.parameters(), model_c.parameters()))
assert opt_a.accountant.epsilon(1e-5) == opt_c.accountant.epsilon(1e-5)
print("seeded: resumed == uninterrupted, bit for bit; the restore warned", caught)

# Default (no seed): the checkpoint holds no generator state and the resumed run draws fresh noise.
model_d, opt_d, loader_d = build()
train(model_d, opt_d, loader_d, 3)
assert "generator_state" not in opt_d.state_dict()["noise"]
model_e, opt_e, loader_e, caught = resume(save(model_d, opt_d, loader_d))
train(model_e, opt_e, loader_e, 3)
print("default: resumed with fresh noise, no warning:", caught == [], "| steps:", opt_e.steps,
      "| epsilon:", round(opt_e.accountant.epsilon(1e-5), 3))
