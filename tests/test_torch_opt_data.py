"""Poisson sampling, empty batches and the data loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from test_torch_opt_support import flat_vec, mlp
from torch import nn
from torch.utils.data import TensorDataset

from adaclip import reference
from adaclip.errors import InvalidGradientError, InvalidHyperparameterError
from adaclip_torch import (
    AdaClip,
    NoiseSource,
    PoissonBatchSampler,
    PoissonUserBatchSampler,
    poisson_data_loader,
)
from adaclip_torch.data import CyclicPoissonBatchSampler, FixedOrderBatchSampler

STD_MIN, STD_MAX = 1e-3, 2.0


def test_poisson_batch_sizes_are_binomial():
    n, q, steps = 500, 0.04, 400
    sampler = PoissonBatchSampler(n, q, num_steps=steps, generator=torch.Generator().manual_seed(0))
    batches = list(sampler)
    sizes = np.array([len(b) for b in batches])
    assert len(batches) == steps == len(sampler)
    assert sampler.expected_batch_size == pytest.approx(q * n)
    # mean qN = 20, sd of the mean sqrt(Nq(1-q)/steps) ≈ 0.22: 5 sd tolerance
    assert abs(sizes.mean() - q * n) < 1.1
    assert abs(sizes.var() - n * q * (1 - q)) < 0.25 * n * q * (1 - q)
    # each index joins independently: per-index inclusion counts are Binomial(steps, q)
    counts = np.bincount(np.concatenate([np.array(b, dtype=int) for b in batches]), minlength=n)
    assert abs(counts.mean() - steps * q) < 0.2
    assert all(len(set(b)) == len(b) and all(0 <= i < n for i in b) for b in batches)


def test_sizes_pass_a_chi_square_against_binomial():
    n, q, steps = 40, 0.1, 2000
    sizes = np.array([len(b) for b in PoissonBatchSampler(n, q, num_steps=steps,
                                                          generator=torch.Generator().manual_seed(1))])
    expected = stats.binom(n, q)
    bins = np.arange(0, 9)
    observed = np.array([(sizes == k).sum() for k in bins[:-1]] + [(sizes >= bins[-1]).sum()])
    probs = np.array([expected.pmf(k) for k in bins[:-1]] + [expected.sf(bins[-1] - 1)])
    assert stats.chisquare(observed, probs * steps).pvalue > 1e-3


def test_default_num_steps_is_one_epoch_in_expectation():
    assert len(PoissonBatchSampler(1000, 0.01, generator=torch.Generator().manual_seed(0))) == 100


@pytest.mark.parametrize("kwargs", [
    {"num_samples": 0, "sample_rate": 0.1}, {"num_samples": 10, "sample_rate": 0.0},
    {"num_samples": 10, "sample_rate": 1.5}, {"num_samples": 10, "sample_rate": 0.1, "num_steps": 0},
])
def test_sampler_rejects_bad_arguments(kwargs):
    with pytest.raises(InvalidHyperparameterError):
        PoissonBatchSampler(**kwargs)


def _dataset(n=30, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g))


def test_loader_yields_zero_length_batches_at_tiny_rate():
    loader = poisson_data_loader(_dataset(), 0.002, num_steps=20, generator=torch.Generator().manual_seed(0))
    shapes = [(x.shape, y.shape, x.dtype, y.dtype) for x, y in loader]
    assert any(s[0] == (0, 6) and s[1] == (0,) for s in shapes)
    assert all(s[2] == torch.float64 and s[3] == torch.int64 for s in shapes)


def test_loader_rejects_batch_size():
    with pytest.raises(InvalidHyperparameterError, match="batch_size"):
        poisson_data_loader(_dataset(), 0.1, batch_size=4)


def _reference_empty(opt, z, sigma, bbar):
    d = sum(p.numel() for p in opt.params)
    return reference.adaclip_step(np.zeros((0, d)), np.zeros(d), np.full(d, np.sqrt(STD_MIN * STD_MAX)), z,
                                  noise_multiplier=sigma, expected_batch_size=bbar, std_min=STD_MIN,
                                  std_max=STD_MAX, allow_empty=True)


def test_empty_batch_step_releases_noise_only():
    model = mlp(0)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.2, expected_batch_size=3,
                  std_min=STD_MIN, std_max=STD_MAX, seed=6, attach_hooks=False, preset="patent")
    z = flat_vec(NoiseSource(seed=6).standard_normal(opt.params))
    for p in opt.params:  # what a forward/backward on a zero-length batch leaves
        p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype)
    opt.step()
    expected, _, std = _reference_empty(opt, z, 1.2, 3)
    np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(flat_vec(opt.clip_state.std), std, rtol=1e-10)


def test_empty_batch_flag_for_models_that_cannot_run_empty():
    model = mlp(0)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.2, expected_batch_size=3,
                  std_min=STD_MIN, std_max=STD_MAX, seed=6, attach_hooks=False, preset="patent")
    z = flat_vec(NoiseSource(seed=6).standard_normal(opt.params))
    opt.step(empty_batch=True)
    expected, _, _ = _reference_empty(opt, z, 1.2, 3)
    np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=1e-10, atol=1e-13)
    assert opt.steps == 1


def test_empty_batch_flag_with_gradients_present_is_an_error():
    model = mlp(0)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0, expected_batch_size=3,
                  attach_hooks=False, preset="patent")
    for p in opt.params:
        p.grad_sample = torch.zeros((2, *p.shape), dtype=p.dtype)
    with pytest.raises(InvalidGradientError, match="empty_batch"):
        opt.step(empty_batch=True)
    assert opt.steps == 0


def test_training_loop_over_poisson_loader_with_engine_runs_through_empty_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3)).double()
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=1.0,
                  expected_batch_size=30 * 0.02, seed=0, preset="patent")
    loader = poisson_data_loader(_dataset(), 0.02, num_steps=15, generator=torch.Generator().manual_seed(2))
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        if len(x):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        else:
            opt.step(empty_batch=True)
        opt.zero_grad()
    assert 0 in sizes and any(sizes)
    assert opt.steps == 15
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_user_sampler_takes_whole_users_at_rate_q():
    user_of = torch.tensor([3, 1, 3, 7, 1, 1, 9, 7, 3, 9] * 10)  # 4 users
    sampler = PoissonUserBatchSampler(user_of, 0.25, num_steps=800, generator=torch.Generator().manual_seed(0))
    assert sampler.num_users == 4 and sampler.expected_batch_size == pytest.approx(1.0)
    users_per_step = []
    for idx in sampler:
        chosen = set(user_of[idx].tolist())
        users_per_step.append(len(chosen))
        # every example of a chosen user is in the batch, and nothing else
        assert sorted(idx) == sorted(i for i in range(len(user_of)) if int(user_of[i]) in chosen)
    assert abs(np.mean(users_per_step) - 1.0) < 0.1
    assert 0 in users_per_step


def test_user_level_loop_matches_reference_on_user_sums():
    user_of = torch.tensor([0, 1, 0, 2, 1, 2, 2, 0])
    ds = _dataset(n=8)
    sampler = PoissonUserBatchSampler(user_of, 1.0, num_steps=1, generator=torch.Generator().manual_seed(0))
    model = mlp(0)
    opt = AdaClip(torch.optim.SGD(model.parameters(), lr=0.0), model, noise_multiplier=0.0,
                  expected_batch_size=sampler.expected_batch_size, std_min=STD_MIN, std_max=STD_MAX,
                  attach_hooks=False, preset="patent")
    (idx,) = list(sampler)
    x, y = ds.tensors[0][idx], ds.tensors[1][idx]
    rows = []
    for i in range(len(idx)):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, opt.params)]))
    per_example = torch.stack(rows)
    offsets = np.cumsum([0] + [p.numel() for p in opt.params])
    for k, p in enumerate(opt.params):
        p.grad_sample = per_example[:, offsets[k] : offsets[k + 1]].reshape(len(idx), *p.shape)
    opt.step(user_ids=user_of[idx])
    ids = user_of[idx].numpy()
    users = np.stack([per_example.numpy()[ids == u].sum(0) for u in np.unique(ids)])
    d = users.shape[1]
    expected, _, _ = reference.adaclip_step(users, np.zeros(d), np.full(d, np.sqrt(STD_MIN * STD_MAX)), np.zeros(d),
                                            noise_multiplier=0.0, expected_batch_size=3, std_min=STD_MIN,
                                            std_max=STD_MAX)
    np.testing.assert_allclose(flat_vec(p.grad for p in opt.params), expected, rtol=1e-10, atol=1e-13)


def test_sampler_state_dict_resumes_the_same_batches():
    a = PoissonBatchSampler(50, 0.2, num_steps=3, generator=torch.Generator().manual_seed(5))
    list(a)
    saved = a.state_dict()
    after = list(a)
    b = PoissonBatchSampler(50, 0.2, num_steps=3, generator=torch.Generator().manual_seed(99))
    b.load_state_dict(saved)
    assert list(b) == after


def test_sample_rate_for_refuses_a_batch_larger_than_the_data_set():
    from adaclip_torch.data import sample_rate_for

    assert sample_rate_for(20, 200) == pytest.approx(0.1)
    assert sample_rate_for(200, 200) == 1.0
    assert sample_rate_for(np.int64(5), np.int64(10)) == 0.5
    with pytest.raises(InvalidHyperparameterError, match=r"batch_size=201 is larger than the data set \(200"):
        sample_rate_for(201, 200)


@pytest.mark.parametrize("batch_size, num_samples, name", [
    (0, 10, "batch_size"), (-1, 10, "batch_size"), (float("nan"), 10, "batch_size"), (float("inf"), 10, "batch_size"),
    (True, 10, "batch_size"), ("5", 10, "batch_size"), (5, 0, "num_samples"), (5, 2.5, "num_samples"),
])
def test_sample_rate_for_rejects(batch_size, num_samples, name):
    from adaclip_torch.data import sample_rate_for

    with pytest.raises(InvalidHyperparameterError, match=name):
        sample_rate_for(batch_size, num_samples)


# ----------------------------------------------------------------------------- subsets (indices=)


class _HeldOut(torch.utils.data.Dataset):
    """60 examples of which 0..19 are held out: reading one raises."""

    def __len__(self):
        return 60

    def __getitem__(self, i):
        if i < 20:
            raise AssertionError(f"held-out example {i} was read")
        return torch.full((3,), float(i)), torch.tensor(i)


def test_samplers_over_indices_draw_as_over_positions_and_yield_dataset_indices():
    """indices= maps the same draws to the subset's dataset indices (sorted); N is the subset's."""
    indices = torch.tensor([50, 3, 17, 8, 42, 99])
    mapped = torch.sort(indices).values
    for make in (
        lambda **kw: PoissonBatchSampler(6, 0.5, num_steps=20, generator=torch.Generator().manual_seed(3), **kw),
        lambda **kw: CyclicPoissonBatchSampler(6, 0.25, 2, num_steps=20, generator=torch.Generator().manual_seed(3),
                                               **kw),
        lambda **kw: FixedOrderBatchSampler(6, 4, generator=torch.Generator().manual_seed(3), **kw),
    ):
        plain, sub = make(), make(indices=indices)
        assert sub.num_samples == 6 and torch.equal(sub.indices, mapped) and plain.indices is None
        assert sub.expected_batch_size == plain.expected_batch_size
        for _ in range(2):  # two passes: the cyclic and fixed-order positions carry over
            assert [mapped[b].tolist() for b in plain] == list(sub)


@pytest.mark.parametrize("indices, match", [
    ([1, 2, 2], "repeated"), ([-1, 2, 3], ">= 0"), ([0.5, 1.0, 2.0], "ints"), ([[1, 2, 3]], "ints"),
    ([1, 2], "2 indices for num_samples=3"), (torch.tensor([True, False, True]), "ints"),
])
def test_sampler_indices_must_be_distinct_dataset_indices(indices, match):
    for make in (
        lambda: PoissonBatchSampler(3, 0.5, indices=indices),
        lambda: CyclicPoissonBatchSampler(3, 0.5, 2, indices=indices),
        lambda: FixedOrderBatchSampler(3, 2, indices=indices),
    ):
        with pytest.raises(InvalidHyperparameterError, match=match):
            make()


def test_sampler_state_carries_its_indices_and_refuses_another_set():
    g = torch.Generator
    for make in (
        lambda idx, s: PoissonBatchSampler(4, 0.5, num_steps=5, generator=g().manual_seed(s), indices=idx),
        lambda idx, s: CyclicPoissonBatchSampler(4, 0.25, 2, num_steps=5, generator=g().manual_seed(s), indices=idx),
        lambda idx, s: FixedOrderBatchSampler(4, 2, generator=g().manual_seed(s), indices=idx),
    ):
        first = make([9, 7, 5, 3], 0)
        list(first)
        state = first.state_dict()
        assert torch.equal(state["indices"], torch.tensor([3, 5, 7, 9]))
        same = make([3, 5, 7, 9], 1)
        same.load_state_dict(state)
        assert list(same) == list(first)
        for other in ([3, 5, 7, 8], None):
            with pytest.raises(InvalidHyperparameterError, match="another set of examples"):
                make(other, 0).load_state_dict(state)
        whole = make(None, 0).state_dict()  # the whole data set: the state has no indices (as before)
        assert "indices" not in whole
        with pytest.raises(InvalidHyperparameterError, match="another set of examples"):
            make([3, 5, 7, 9], 0).load_state_dict(whole)


@pytest.mark.parametrize("bands", [1, 2])
def test_poisson_data_loader_over_indices_never_reads_a_held_out_example(bands):
    """Batches (the empty ones' shapes included) come from the 40 training examples only."""
    loader = poisson_data_loader(_HeldOut(), 0.02, num_steps=60, bands=bands, indices=range(20, 60),
                                 generator=torch.Generator().manual_seed(0))
    assert loader.batch_sampler.num_samples == 40 and loader.batch_sampler.expected_batch_size == pytest.approx(0.8)
    seen, sizes = set(), []
    for x, y in loader:
        sizes.append(len(y))
        seen |= set(y.tolist())
        assert x.shape[1:] == (3,)
    assert 0 in sizes and seen and seen <= set(range(20, 60))


def test_poisson_data_loader_refuses_indices_past_the_data_set_and_names_indices_for_a_sampler():
    with pytest.raises(InvalidHyperparameterError, match="go up to 60"):
        poisson_data_loader(_HeldOut(), 0.1, indices=range(20, 61))
    with pytest.raises(InvalidHyperparameterError, match="indices="):
        poisson_data_loader(_HeldOut(), 0.1, sampler=range(20, 60))
