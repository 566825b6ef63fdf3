"""The wrapper with the real grad-sample hooks, on several model families, against the reference.

The per-example gradients that decide correctness come from one backward per example
(``microbatch_per_example``), never from the engine under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_torch_opt_support import flat, flat_vec, microbatch_per_example
from torch import nn

from adaclip import reference
from adaclip.errors import NoiseReplayWarning
from adaclip_torch import AdaClip, FlatClip

STD_MIN, STD_MAX = 1e-3, 2.0


class TiedLSTM(nn.Module):
    """Language model whose output layer reuses the embedding matrix."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        h, _ = self.lstm(self.embed(tokens))
        return self.out(h[:, -1])


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.norm = nn.GroupNorm(1, 3)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


class BagModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(13, 5, mode="mean")
        self.fc = nn.Linear(5, 3)

    def forward(self, tokens):
        return self.fc(self.bag(tokens))


def _case(name: str, n: int = 6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
        x = torch.randn(n, 5, generator=g)
        y = torch.randint(0, 3, (n,), generator=g)
    elif name == "cnn":
        model = SmallCNN()
        x = torch.randn(n, 1, 6, 6, generator=g)
        y = torch.randint(0, 4, (n,), generator=g)
    elif name == "lstm_tied":
        model = TiedLSTM()
        x = torch.randint(0, 11, (n, 4), generator=g)
        y = torch.randint(0, 11, (n,), generator=g)
    elif name == "embedding_bag":
        model = BagModel()
        x = torch.randint(0, 13, (n, 3), generator=g)
        y = torch.randint(0, 3, (n,), generator=g)
    else:
        raise AssertionError(name)
    return model.double(), (x.double() if x.is_floating_point() else x), y


@pytest.mark.parametrize("name", ["mlp", "cnn", "lstm_tied", "embedding_bag"])
def test_adaclip_with_engine_matches_reference(name):
    model, x, y = _case(name)
    twin, _, _ = _case(name)  # hook-free copy for the one-backward-per-example reference
    loss_fn = nn.CrossEntropyLoss()
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.05), model, noise_multiplier=0.0,
                  expected_batch_size=6, std_min=STD_MIN, std_max=STD_MAX, preset="patent")
    d = sum(p.numel() for p in opt.params)
    mean, std = np.zeros(d), np.full(d, np.sqrt(STD_MIN * STD_MAX))
    for _ in range(2):
        twin.load_state_dict(model.state_dict())
        expected_per_example = microbatch_per_example(twin, list(twin.parameters()), loss_fn, x, y)
        expected, mean, std = reference.adaclip_step(
            flat(expected_per_example), mean, std, np.zeros(d), noise_multiplier=0.0,
            expected_batch_size=6, std_min=STD_MIN, std_max=STD_MAX,
        )
        loss_fn(model(x), y).backward()
        opt.step()
        np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=1e-8, atol=1e-11)
        np.testing.assert_allclose(flat_vec(opt.clip_state.std), std, rtol=1e-8, atol=1e-12)
        opt.zero_grad()
        assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_flat_clip_with_engine_and_sum_reduction():
    model, x, y = _case("mlp")
    twin, _, _ = _case("mlp")
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    per_example = microbatch_per_example(twin, list(twin.parameters()), loss_fn, x, y)
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.05), model, max_grad_norm=0.2, noise_multiplier=0.0,
                   expected_batch_size=4, loss_reduction="sum")
    expected = reference.flat_clip_step(flat(per_example), np.zeros(flat(per_example).shape[1]),
                                        max_grad_norm=0.2, noise_multiplier=0.0, expected_batch_size=4)
    loss_fn(model(x), y).backward()
    opt.step()
    np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=1e-8, atol=1e-11)


def test_empty_batch_releases_noise_only_with_engine():
    model, x, y = _case("mlp")
    opt = FlatClip(torch.optim.SGD(model.parameters(), lr=0.0), model, max_grad_norm=1.0, noise_multiplier=0.0,
                   expected_batch_size=4)
    nn.CrossEntropyLoss()(model(x[:0]), y[:0]).backward()
    opt.step()
    assert opt.steps == 1
    assert all(torch.count_nonzero(p.grad) == 0 for p in opt.params)


def test_virtual_steps_with_engine_equal_one_big_step():
    released = []
    for chunks in ([slice(0, 6)], [slice(0, 2), slice(2, 5), slice(5, 6)]):
        model, x, y = _case("cnn")
        opt = AdaClip(torch.optim.Adam(model.parameters(), lr=1e-2), model, noise_multiplier=0.7,
                      expected_batch_size=6, std_min=STD_MIN, std_max=STD_MAX, seed=4, preset="patent")
        for sl in chunks[:-1]:
            nn.CrossEntropyLoss()(model(x[sl]), y[sl]).backward()
            opt.accumulate()
        nn.CrossEntropyLoss()(model(x[chunks[-1]]), y[chunks[-1]]).backward()
        opt.step()
        released.append([p.detach().clone() for p in model.parameters()])
        opt.remove_hooks()
    for a, b in zip(*released):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_end_to_end_resume_with_engine_loader_and_accountant(tmp_path):
    from torch.utils.data import TensorDataset

    from adaclip.accounting import Accountant
    from adaclip_torch import poisson_data_loader

    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(40, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (40,), generator=g))

    def build():
        model, _, _ = _case("mlp")
        opt = AdaClip(torch.optim.Adam(model.parameters(), lr=1e-2), model, noise_multiplier=1.0,
                      expected_batch_size=8, std_min=STD_MIN, std_max=STD_MAX, seed=7,
                      accountant=Accountant("rdp"), sample_rate=0.2, preset="patent")
        loader = poisson_data_loader(ds, 0.2, num_steps=3, generator=torch.Generator().manual_seed(1))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, loader, sched

    def epoch(model, opt, loader, sched):
        for x, y in loader:
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()

    model_a, opt_a, loader_a, sched_a = build()
    for _ in range(2):
        epoch(model_a, opt_a, loader_a, sched_a)
    opt_a.remove_hooks()

    model_b, opt_b, loader_b, sched_b = build()
    epoch(model_b, opt_b, loader_b, sched_b)
    torch.save({"model": model_b.state_dict(), "opt": opt_b.state_dict(), "sched": sched_b.state_dict(),
                "sampler": loader_b.batch_sampler.state_dict()}, tmp_path / "ckpt.pt")
    opt_b.remove_hooks()

    model_c, opt_c, loader_c, sched_c = build()
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    model_c.load_state_dict(ckpt["model"])
    with pytest.warns(NoiseReplayWarning):  # seeded: a bit-for-bit resume replays the noise
        opt_c.load_state_dict(ckpt["opt"])
    sched_c.load_state_dict(ckpt["sched"])
    loader_c.batch_sampler.load_state_dict(ckpt["sampler"])
    epoch(model_c, opt_c, loader_c, sched_c)

    for a, c in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(a, c)
    assert opt_c.accountant.steps == opt_a.accountant.steps == 6
    assert opt_c.accountant.epsilon(1e-5) == opt_a.accountant.epsilon(1e-5)
