"""Banded correlated noise in the Flower wrappers (ServerSideClipping), driven by hand with a
fake grid: the released noise against the core's NumPy reference, b = 1 against independent
noise bit for bit, cyclic Poisson sampling of the nodes, accounting per cycle, refusals."""

import math

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from adaclip import AdaptiveClipping, FlatClipping, QuantileClipping, QuantileRule  # noqa: E402
from adaclip.accounting import Accountant  # noqa: E402
from adaclip.correlated import BandedNoise  # noqa: E402
from adaclip.correlated.coefficients import sqrt_toeplitz_coefficients  # noqa: E402
from adaclip.errors import BudgetExceededError, InvalidHyperparameterError  # noqa: E402
from adaclip_flower import ClientSideClipping, ServerSideClipping  # noqa: E402
from adaclip_flower import aggregation as agg  # noqa: E402

SHAPES = {"w": (3, 2), "b": (4,)}


@pytest.fixture(autouse=True)
def _task_identity(flower_task_identity):
    """Every test here builds Flower messages (tests/conftest.py)."""


class FakeGrid:
    def __init__(self, n, first=101):
        self.ids = list(range(first, first + n))

    def get_node_ids(self):
        return list(self.ids)


def _global(value=0.0, dtype=np.float64):
    return ArrayRecord({k: Array(np.full(s, value, dtype=dtype)) for k, s in SHAPES.items()})


def _flat(rec):
    return np.concatenate([np.ravel(a.numpy()) for a in rec.values()])


def _user_update(node):
    rng = np.random.default_rng(node)
    return {k: rng.standard_normal(s) for k, s in SHAPES.items()}


def _replies(msgs, zero=False):
    """Each sampled node replies θ (zero update) or θ + its own update."""
    out = []
    for m in msgs:
        theta = {k: a.numpy() for k, a in m.content["arrays"].items()}
        upd = _user_update(m.metadata.dst_node_id)
        arrays = {k: theta[k] if zero else (theta[k] + upd[k]).astype(theta[k].dtype) for k in SHAPES}
        content = RecordDict({"arrays": ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()}),
                              "metrics": MetricRecord({"num-examples": 5})})
        out.append(Message(content=content, reply_to=m))
    return out


def _leaves(state):
    """The arrays of a ClipState (mean, std, option state)."""
    out = []
    for part in (state.mean, state.std, *(state.extra or {}).values()):
        for a in (part if isinstance(part, (list, tuple)) else [part]) if part is not None else []:
            if a is not None:
                out.append(np.asarray(a, dtype=np.float64))
    return out


def _wrapper(cls=ServerSideClipping, **kw):
    kw.setdefault("clipping", FlatClipping(max_grad_norm=1.0))
    kw.setdefault("noise_multiplier", 1.3)
    kw.setdefault("sample_rate", 0.2)
    kw.setdefault("num_users", 20)
    kw.setdefault("delta", 1e-5)
    kw.setdefault("seed", 3)
    return cls(FedAvg(), **kw)


def _run(st, rounds, grid=None, zero=False, arrays=None):
    """Drive ``rounds`` rounds; returns the sampled nodes, the released mean updates (flat)
    and the last metrics."""
    grid = grid or FakeGrid(st.mechanism.num_users)
    arrays = arrays or _global()
    sampled, released, metrics = [], [], None
    for rnd in range(1, rounds + 1):
        msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), grid))
        sampled.append([m.metadata.dst_node_id for m in msgs])
        new, metrics = st.aggregate_train(rnd, _replies(msgs, zero=zero))
        released.append(_flat(new) - _flat(arrays))
        arrays = new
    return sampled, released, metrics


# --------------------------------------------------------------------------- the noise


@pytest.mark.parametrize("bands", [2, 4])
def test_zero_updates_release_sigma_x_over_bbar_of_the_numpy_reference(bands):
    """With zero updates the b = 1 release is σ·z_t/B̄; the banded one, on the same draws (same
    seed: the noise generator is not the sampler's), must be σ·x_t/B̄ with x_t the core's
    BandedNoise.correlate of those z_t."""
    sigma, rounds = 1.3, 9
    _, independent, _ = _run(_wrapper(noise_multiplier=sigma), rounds, zero=True)
    st = _wrapper(noise_multiplier=sigma, noise_mechanism="banded", bands=bands)
    _, banded, _ = _run(st, rounds, zero=True)
    bbar = st.mechanism.expected_batch_size
    mech = BandedNoise(sqrt_toeplitz_coefficients(bands))
    state = mech.init()
    for t in range(rounds):
        z = independent[t] * bbar / sigma
        (x,), state = mech.correlate(state, [z])
        np.testing.assert_allclose(banded[t], sigma * x / bbar, rtol=1e-10, atol=1e-12)
    assert not np.allclose(banded[1], independent[1])  # the correlation did something
    # the buffers are the last b − 1 noise vectors, most recent first
    assert st._stream.step == rounds and len(st._stream.history) == bands - 1
    np.testing.assert_allclose(np.concatenate([h.ravel() for h in st._stream.history[0]]),
                               state.history[0][0], rtol=1e-12)


def test_adaclip_rounds_equal_the_reference_with_the_noise_variance():
    """Real updates and AdaCliP: each round equals aggregate_updates with the correlated draws
    and noise_variance = v_t (which AdaCliP's statistics subtract), not v = 1."""
    clipping = AdaptiveClipping(std_min=0.01, std_max=1.0)
    st = _wrapper(clipping=clipping, noise_mechanism="banded", bands=3, sample_rate=0.3, noise_multiplier=0.7)
    mech = st.mechanism.noise_mechanism
    gen = agg.noise_generator(3 + 1)  # the server's noise generator: seed + 1
    stream = mech.init()
    like = [np.zeros(s) for s in SHAPES.values()]
    arrays = _global()
    state = None
    for rnd in range(1, 6):
        msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), FakeGrid(20)))
        state = st.clip_state if state is None else state
        ups = [[_user_update(m.metadata.dst_node_id)[k] for k in SHAPES] for m in msgs]
        z = agg.standard_normal_like(like, gen)
        x, stream = mech.correlate(stream, z)
        v = mech.variance(rnd - 1)
        assert v > 1.0
        expected, state_next = agg.aggregate_updates(st.mechanism, state, agg.stack_updates(ups, like),
                                                     noise=x, noise_variance=v)
        _, naive = agg.aggregate_updates(st.mechanism, state, agg.stack_updates(ups, like), noise=x)
        new, _ = st.aggregate_train(rnd, _replies(msgs))
        np.testing.assert_allclose(_flat(new) - _flat(arrays), np.concatenate([e.ravel() for e in expected]),
                                   rtol=1e-10, atol=1e-12)
        for a, b in zip(_leaves(st.clip_state), _leaves(state_next), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-14)
        assert any(not np.allclose(a, b) for a, b in zip(_leaves(state_next), _leaves(naive), strict=True))
        state, arrays = state_next, new


def test_correlate_noise_leaves_the_auxiliary_sums_independent():
    st = _wrapper(clipping=QuantileClipping(max_grad_norm=1.0, quantile=QuantileRule(count_noise_multiplier=1.0)), noise_mechanism="banded", bands=4)
    m = st.mechanism
    like = [np.zeros(s) for s in SHAPES.values()]
    stream = m.noise_mechanism.init()
    for _ in range(3):
        z = agg.standard_normal_like(like, np.random.default_rng(0), extra=1)
        noise, v, stream = agg.correlate_noise(m, stream, z)
        assert len(noise) == 3 and noise[2] is z[2]
    assert v == m.noise_mechanism.variance(2) and stream.step == 3
    assert len(stream.history) == 3 and len(stream.history[0]) == 2  # the auxiliary draw is not kept
    st1 = _wrapper()
    same, v1, s1 = agg.correlate_noise(st1.mechanism, stream, z)
    assert v1 == 1.0 and s1 is stream and all(a is b for a, b in zip(same, z, strict=True))


@pytest.mark.parametrize("clipping", [FlatClipping(max_grad_norm=0.7), AdaptiveClipping(std_min=0.01, std_max=1.0),
                                      QuantileClipping(max_grad_norm=0.7, quantile=QuantileRule(count_noise_multiplier=1.0))])
@pytest.mark.parametrize("mechanism", [{"noise_mechanism": "banded", "bands": 1}, {"noise_mechanism": BandedNoise([1.0])}])
def test_one_band_is_independent_noise_bit_for_bit(clipping, mechanism):
    acc_a, acc_b = Accountant("rdp"), Accountant("rdp")
    a = _wrapper(clipping=clipping, accountant=acc_a, sample_rate=0.3)
    b = _wrapper(clipping=clipping, accountant=acc_b, sample_rate=0.3, **mechanism)
    sa, ra, ma = _run(a, 6)
    sb, rb, mb = _run(b, 6)
    assert sa == sb
    for x, y in zip(ra, rb, strict=True):
        np.testing.assert_array_equal(x, y)
    assert acc_a.history == acc_b.history == ((0.3, 1.3, 6),)
    assert ma["epsilon"] == mb["epsilon"]
    assert len(_leaves(a.clip_state)) == len(_leaves(b.clip_state))
    for x, y in zip(_leaves(a.clip_state), _leaves(b.clip_state), strict=True):
        np.testing.assert_array_equal(x, y)
    assert mb["bands"] == 1 and mb["compositions"] == mb["rounds-released"] == 6


# --------------------------------------------------------------------------- accounting


@pytest.mark.parametrize("bands,rounds", [(3, 7), (4, 8), (2, 1)])
def test_the_accountant_records_ceil_t_over_b_compositions_at_p(bands, rounds, tmp_path):
    q, sigma = 0.2, 1.1
    ledger = tmp_path / "ledger"
    acc = Accountant("rdp", ledger=ledger)
    st = _wrapper(accountant=acc, sample_rate=q, noise_multiplier=sigma, noise_mechanism="banded", bands=bands)
    p = bands * q
    for t in range(rounds):
        msgs = list(st.configure_train(t + 1, _global(), ConfigRecord(), FakeGrid(20)))
        _, metrics = st.aggregate_train(t + 1, _replies(msgs))
        # recorded at the first round of each cycle, before its release
        assert acc.steps == t // bands + 1
    k = math.ceil(rounds / bands)
    assert [tuple(r) for r in acc.history] == [(pytest.approx(p), sigma, k)]
    fresh = Accountant("rdp")
    fresh.step(noise_multiplier=sigma, sample_rate=p, num_steps=k)
    assert metrics["epsilon"] == pytest.approx(fresh.epsilon(1e-5), rel=1e-12)
    assert metrics["rounds-released"] == rounds and metrics["compositions"] == k
    assert metrics["bands"] == bands and metrics["accounted-sample-rate"] == pytest.approx(p)
    acc.close()
    assert Accountant("rdp", ledger=ledger).steps == k  # the ledger was written ahead once per cycle


def test_a_new_strategy_on_the_same_ledger_opens_a_new_cycle(tmp_path):
    """No state is saved: after a restart (a new strategy object on the ledger) the stream, the
    groups and the cycle start afresh, and its first round records a composition."""
    ledger = tmp_path / "ledger"
    acc = Accountant("rdp", ledger=ledger)
    first = _wrapper(accountant=acc, noise_mechanism="banded", bands=3)
    _run(first, 2)
    assert acc.steps == 1
    acc.close()
    acc = Accountant("rdp", ledger=ledger)
    second = _wrapper(accountant=acc, noise_mechanism="banded", bands=3, seed=9)
    assert second.rounds_released == 0 and second._stream.step == 0 and not second._groups
    _, _, metrics = _run(second, 2)
    assert acc.steps == 2 and metrics["compositions"] == 2 and metrics["rounds-released"] == 2
    acc.close()


def test_the_budget_is_checked_at_cycle_openings_only():
    """Room for exactly two compositions: the two cycles of b rounds are released in full, the
    round that would open a third is refused before anything is sent."""
    q, sigma, bands = 0.2, 1.0, 3
    probe = Accountant("rdp")
    probe.step(noise_multiplier=sigma, sample_rate=bands * q, num_steps=2)
    target = probe.epsilon(1e-5) * (1 + 1e-9)
    acc = Accountant("rdp", target_epsilon=target, delta=1e-5)
    st = _wrapper(accountant=acc, sample_rate=q, noise_multiplier=sigma, noise_mechanism="banded", bands=bands,
                  delta=None)
    arrays = _global()
    for rnd in range(1, 2 * bands + 1):
        msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), FakeGrid(20)))
        arrays, _ = st.aggregate_train(rnd, _replies(msgs))
    assert st.rounds_released == 2 * bands and acc.steps == 2
    with pytest.raises(BudgetExceededError):
        st.configure_train(2 * bands + 1, arrays, ConfigRecord(), FakeGrid(20))
    assert st.rounds_released == 2 * bands and acc.steps == 2 and st.epsilon <= target


# --------------------------------------------------------------------------- sampling


def test_cyclic_poisson_sampling_of_the_nodes():
    """Each node belongs to one group, drawn when it is first seen; it is sampled only in its
    group's rounds (so at most once in any b consecutive rounds), at rate p = b·q there."""
    bands, q, rounds = 4, 0.2, 200
    st = _wrapper(sample_rate=q, noise_mechanism="banded", bands=bands, noise_multiplier=0.0, num_users=60)
    grid = FakeGrid(40)
    sampled = []
    for rnd in range(1, rounds + 1):
        if rnd == 50:
            grid.ids += list(range(1000, 1020))  # nodes that connect later get a group then
        msgs = list(st.configure_train(rnd, _global(), ConfigRecord(), grid))
        ids = [m.metadata.dst_node_id for m in msgs]
        assert len(set(ids)) == len(ids)
        sampled.append(ids)
        st.aggregate_train(rnd, [])
    groups = dict(st._groups)
    assert set(groups) == set(grid.ids) and set(groups.values()) <= set(range(bands))
    last = {}
    joins = 0
    for t, ids in enumerate(sampled):
        for node in ids:
            assert groups[node] == t % bands
            assert t - last.get(node, -bands) >= bands
            last[node] = t
        joins += len(ids)
    # per node, in its group's rounds while connected: Binomial at rate p = b·q
    chances = sum(sum(1 for t in range(rounds) if t % bands == groups[n] and (n < 1000 or t >= 49)) for n in groups)
    p = bands * q
    assert abs(joins / chances - p) < 4 * math.sqrt(p * (1 - p) / chances)
    assert set(groups.values()) == set(range(bands))


def test_group_assignment_is_independent_and_uniform():
    from scipy import stats

    bands = 5
    st = _wrapper(sample_rate=0.1, noise_mechanism="banded", bands=bands, noise_multiplier=0.0, num_users=2000)
    st.configure_train(1, _global(), ConfigRecord(), FakeGrid(2000))
    counts = np.bincount(list(st._groups.values()), minlength=bands)
    assert stats.chisquare(counts).pvalue > 1e-4
    other = _wrapper(sample_rate=0.1, noise_mechanism="banded", bands=bands, noise_multiplier=0.0, num_users=2000,
                     seed=4)
    other.configure_train(1, _global(), ConfigRecord(), FakeGrid(2000))
    assert list(other._groups.values()) != list(st._groups.values())


def test_a_round_configured_out_of_turn_is_refused():
    """With banded noise a round must be aggregated before the next is configured: a round
    whose group's turn has passed is refused and nothing is released or accounted."""
    st = _wrapper(noise_mechanism="banded", bands=2)
    first = list(st.configure_train(1, _global(), ConfigRecord(), FakeGrid(20)))
    second = list(st.configure_train(2, _global(), ConfigRecord(), FakeGrid(20)))
    st.aggregate_train(2, _replies(second))
    with pytest.raises(InvalidHyperparameterError, match="released since"):
        st.aggregate_train(1, _replies(first))
    assert st.rounds_released == 1 and st.accountant.steps == 1
    with pytest.raises(InvalidHyperparameterError, match="not configured"):
        st.aggregate_train(1, [])


def test_nothing_secret_leaves_with_the_messages_or_metrics():
    st = _wrapper(noise_mechanism="banded", bands=3)
    plain = _wrapper()
    for rnd in (1, 2):
        msgs = list(st.configure_train(rnd, _global(), ConfigRecord(), FakeGrid(20)))
        ref = list(plain.configure_train(rnd, _global(), ConfigRecord(), FakeGrid(20)))
        for m in msgs:
            assert set(m.content.keys()) == set(ref[0].content.keys()) == {"arrays", "config"}
            assert dict(m.content["config"]) == dict(ref[0].content["config"])
        _, metrics = st.aggregate_train(rnd, _replies(msgs))
        plain.aggregate_train(rnd, _replies(ref))
    assert set(metrics.keys()) == {"epsilon", "delta", "noise-multiplier", "sample-rate", "rounds-released",
                                   "bands", "accounted-sample-rate", "compositions"}


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"noise_mechanism": "banded", "bands": 6, "sample_rate": 0.2}, "b·q"),
        ({"noise_mechanism": "banded"}, "needs bands"),
        ({"noise_mechanism": "banded", "bands": 0}, "positive int"),
        ({"noise_mechanism": "independent", "bands": 3}, "needs noise_mechanism='banded'"),
        ({"noise_mechanism": BandedNoise(sqrt_toeplitz_coefficients(3)), "bands": 2}, "disagrees"),
        ({"noise_mechanism": "tree"}, "noise_mechanism must be"),
        ({"noise_mechanism": [1.0, 0.0]}, "noise_mechanism must be"),
    ],
)
def test_bad_noise_mechanisms_are_refused(kwargs, match):
    with pytest.raises(InvalidHyperparameterError, match=match):
        _wrapper(**kwargs)


def test_b_times_q_equal_to_one_is_allowed():
    st = _wrapper(noise_mechanism="banded", bands=5, sample_rate=0.2)
    assert st.mechanism.accounted_sample_rate == 1.0


def test_client_side_clipping_refuses_banded_noise():
    with pytest.raises(InvalidHyperparameterError, match="client-side clipping cannot use banded noise"):
        _wrapper(ClientSideClipping, noise_mechanism="banded", bands=2)
    with pytest.raises(InvalidHyperparameterError, match="ServerSideClipping"):
        _wrapper(ClientSideClipping, noise_mechanism=BandedNoise(sqrt_toeplitz_coefficients(4)))
    one = _wrapper(ClientSideClipping, noise_mechanism="banded", bands=1)  # one band: independent noise
    assert one.mechanism.bands == 1


def test_banded_noise_is_announced_with_b_cyclic_sampling_and_cycles(caplog):
    import logging

    class SilentGrid(FakeGrid):
        def send_and_receive(self, messages, timeout=None):
            list(messages)
            return []

    caplog.set_level(logging.INFO, logger="adaclip_flower.server")
    st = _wrapper(noise_mechanism="banded", bands=4, noise_multiplier=1.5, sample_rate=0.1, num_users=40,
                  accountant=Accountant("rdp"))
    st.start(grid=SilentGrid(40), initial_arrays=_global(), num_rounds=8)
    (record,) = [r for r in caplog.records if r.name == "adaclip_flower.server"]
    text = record.getMessage()
    assert "ServerSideClipping built user-level DP-FedAvg: banded correlated noise, b = 4 (amplified BandMF)" in text
    assert ("users cyclically Poisson-sampled: 4 groups drawn at random, round t samples group t mod 4 at p = b*q = "
            "0.4 (q = 0.1 of 40, 4 expected per round)") in text
    assert "8 planned rounds, accounted as 2 compositions at rate 0.4; epsilon = " in text
    assert (st.noise_mechanism, st.bands, st.accounted_sample_rate, st.planned_compositions) == ("banded", 4, 0.4, 2)
    assert st.accountant.steps == 2 and st.planned_epsilon() == pytest.approx(st.epsilon, rel=1e-12)
