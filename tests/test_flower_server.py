"""The Flower strategy wrappers and client mod, driven by hand (no simulation engine): every
round against the NumPy reference, bad replies, the accountant, the budget, the mod."""

import logging
import re

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM  # noqa: E402

from adaclip import AdaptiveClipping, FlatClipping, PerLayerClipping  # noqa: E402
from adaclip.accounting import Accountant  # noqa: E402
from adaclip.errors import BudgetExceededError, InvalidHyperparameterError  # noqa: E402
from adaclip_flower import ClientSideClipping, ServerSideClipping, adaclip_mod  # noqa: E402
from adaclip_flower import aggregation as agg  # noqa: E402

SHAPES = {"w": (3, 2), "b": (4,)}


@pytest.fixture(autouse=True)
def _task_identity(flower_task_identity):
    """Every test here builds Flower messages (tests/conftest.py)."""


class FakeGrid:
    def __init__(self, n):
        self.ids = list(range(101, 101 + n))

    def get_node_ids(self):
        return list(self.ids)


def _global(value=0.0):
    return ArrayRecord({k: Array(np.full(s, value, dtype=np.float32)) for k, s in SHAPES.items()})


def _user_update(node, scale=1.0):
    rng = np.random.default_rng(node)
    return {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def _reply(msg, arrays, num_examples=5, key="arrays"):
    content = RecordDict({key: ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()}),
                          "metrics": MetricRecord({"num-examples": num_examples})})
    return Message(content=content, reply_to=msg)


def _train_replies(msgs, scale=1.0):
    out = []
    for m in msgs:
        theta = {k: a.numpy() for k, a in m.content["arrays"].items()}
        upd = _user_update(m.metadata.dst_node_id, scale)
        out.append(_reply(m, {k: theta[k] + upd[k] for k in SHAPES}))
    return out


def _wrapper(cls=ServerSideClipping, inner=None, **kw):
    kw.setdefault("clipping", FlatClipping(max_grad_norm=1.0))
    kw.setdefault("noise_multiplier", 1.0)
    kw.setdefault("sample_rate", 0.3)
    kw.setdefault("num_users", 20)
    kw.setdefault("delta", 1e-5)
    kw.setdefault("seed", 0)
    return cls(inner or FedAvg(), **kw)


def _flat_record(rec):
    return np.concatenate([np.ravel(a.numpy()) for a in rec.values()])


def _reference(strategy_like, state, msgs, theta, noise_seed, *, weights=None, drop=()):
    """The release the server should make: the same updates through the NumPy reference, with
    the noise the wrapper's seeded generator draws."""
    like = [np.zeros(s) for s in SHAPES.values()]
    ups = []
    for m in msgs:
        node = m.metadata.dst_node_id
        u = _user_update(node)
        ups.append(None if node in drop else [u[k].astype(np.float64) for k in SHAPES])
    noise = None
    if strategy_like.noise_multiplier > 0:
        noise = agg.standard_normal_like(like, agg.noise_generator(noise_seed))
    out, _ = agg.aggregate_updates(strategy_like, state, agg.stack_updates(ups, like), weights=weights, noise=noise)
    return np.concatenate([np.ravel(o) for o in out]) + theta


@pytest.mark.parametrize("clipping", [FlatClipping(max_grad_norm=0.7), PerLayerClipping(max_grad_norm=0.7),
                                      AdaptiveClipping(std_min=0.01, std_max=1.0)])
def test_rounds_equal_the_reference(clipping):
    st = _wrapper(clipping=clipping, noise_multiplier=1.2)
    arrays = _global()
    state = None
    for rnd in (1, 2, 3):
        msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), FakeGrid(20)))
        state = st.clip_state
        noise_gen_state = st._noise.bit_generator.state
        ref_gen = np.random.default_rng()
        ref_gen.bit_generator.state = noise_gen_state
        like = [np.zeros(s) for s in SHAPES.values()]
        ups = [[_user_update(m.metadata.dst_node_id)[k].astype(np.float64) for k in SHAPES] for m in msgs]
        noise = agg.standard_normal_like(like, ref_gen)
        expected, _ = agg.aggregate_updates(st.mechanism, state, agg.stack_updates(ups, like), noise=noise)
        theta = _flat_record(arrays).astype(np.float64)
        new, metrics = st.aggregate_train(rnd, _train_replies(msgs))
        np.testing.assert_allclose(_flat_record(new), (theta + np.concatenate([e.ravel() for e in expected])).astype(np.float32),
                                   rtol=1e-6, atol=1e-6)
        assert metrics["rounds-released"] == rnd
        arrays = new


def test_sampling_is_poisson_at_the_sample_rate():
    st = _wrapper(sample_rate=0.25, noise_multiplier=0.0)
    counts = []
    for rnd in range(1, 201):
        msgs = list(st.configure_train(rnd, _global(), ConfigRecord(), FakeGrid(40)))
        counts.append(len(msgs))
        assert len({m.metadata.dst_node_id for m in msgs}) == len(msgs)
        st.aggregate_train(rnd, [])
    from scipy import stats

    # Binomial(40, 0.25) per round: the mean within 4 SE, and the variance of a binomial.
    assert abs(np.mean(counts) - 10) < 4 * np.sqrt(40 * 0.25 * 0.75 / 200)
    assert stats.chisquare(np.bincount(np.clip(counts, 5, 15) - 5, minlength=11),
                           f_exp=_binned_binomial(40, 0.25, 200)).pvalue > 1e-3


def _binned_binomial(n, p, rounds):
    from scipy import stats

    k = np.arange(5, 16)
    pmf = stats.binom.pmf(k, n, p)
    pmf[0] = stats.binom.cdf(5, n, p)
    pmf[-1] = stats.binom.sf(14, n, p)
    return pmf * rounds


def test_bad_replies_contribute_nothing_and_never_abort_the_round():
    """Missing reply, error reply, NaN, wrong shape, wrong keys, a string weight: the release
    equals the one without those users, and the round is accounted."""
    st = _wrapper(noise_multiplier=0.9, sample_rate=0.6)
    arrays = _global()
    msgs = list(st.configure_train(1, arrays, ConfigRecord(), FakeGrid(20)))
    assert len(msgs) >= 8
    state = st.clip_state
    gen = np.random.default_rng()
    gen.bit_generator.state = st._noise.bit_generator.state
    good = _train_replies(msgs[5:])
    theta = {k: a.numpy() for k, a in arrays.items()}
    bad = [
        Message(content=RecordDict({}), reply_to=msgs[0]),  # no arrays at all
        _reply(msgs[1], {"w": np.full((3, 2), np.nan, np.float32), "b": np.zeros(4, np.float32)}),
        _reply(msgs[2], {"w": np.zeros((2, 2), np.float32), "b": np.zeros(4, np.float32)}),
        _reply(msgs[3], {"b": np.zeros(4, np.float32), "w": np.zeros((3, 2), np.float32)}),  # key order
        # msgs[4]: dropped out (no reply)
    ]
    new, metrics = st.aggregate_train(1, bad + good)
    like = [np.zeros(s) for s in SHAPES.values()]
    ups = [[_user_update(m.metadata.dst_node_id)[k].astype(np.float64) for k in SHAPES] for m in msgs[5:]]
    expected, _ = agg.aggregate_updates(st.mechanism, state, agg.stack_updates(ups, like),
                                        noise=agg.standard_normal_like(like, gen))
    flat_theta = np.concatenate([theta[k].ravel() for k in SHAPES])
    np.testing.assert_allclose(_flat_record(new), flat_theta + np.concatenate([e.ravel() for e in expected]), rtol=1e-5, atol=1e-6)
    assert st.accountant.steps == 1 and metrics["epsilon"] > 0


def test_no_user_sampled_still_releases_noise_and_accounts():
    st = _wrapper(sample_rate=0.01, noise_multiplier=2.0)
    msgs = list(st.configure_train(1, _global(), ConfigRecord(), FakeGrid(3)))
    assert msgs == []
    new, _ = st.aggregate_train(1, [])
    moved = _flat_record(new)
    assert np.all(moved != 0) and st.accountant.steps == 1


def test_accountant_records_q_sigma_per_round_and_reports_epsilon():
    acc = Accountant("rdp")
    st = _wrapper(accountant=acc, noise_multiplier=1.1, sample_rate=0.3)
    arrays = _global()
    for rnd in range(1, 6):
        msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), FakeGrid(20)))
        arrays, metrics = st.aggregate_train(rnd, _train_replies(msgs))
    assert [tuple(r) for r in acc.history] == [(0.3, 1.1, 5)]
    fresh = Accountant("rdp")
    fresh.step(noise_multiplier=1.1, sample_rate=0.3, num_steps=5)
    assert metrics["epsilon"] == pytest.approx(fresh.epsilon(1e-5), rel=1e-12)
    assert st.epsilon == pytest.approx(fresh.epsilon(1e-5), rel=1e-12)


def test_budget_refuses_a_round_before_anything_is_sent():
    acc = Accountant("rdp", target_epsilon=1.0, delta=1e-5)
    st = _wrapper(accountant=acc, noise_multiplier=0.8, sample_rate=0.3, delta=None)
    arrays = _global()
    rnd = 0
    with pytest.raises(BudgetExceededError):
        for rnd in range(1, 1000):
            msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), FakeGrid(20)))
            arrays, _ = st.aggregate_train(rnd, _train_replies(msgs))
    assert st.accountant.steps == rnd - 1 and st.epsilon <= 1.0
    assert rnd not in st._pending


def test_client_metrics_are_not_forwarded_and_evaluation_is_off_by_default():
    st = _wrapper(noise_multiplier=0.5)
    msgs = list(st.configure_train(1, _global(), ConfigRecord(), FakeGrid(20)))
    replies = []
    for m in msgs:
        r = _train_replies([m])[0]
        r.content["metrics"]["train-loss"] = 0.123
        replies.append(r)
    _, metrics = st.aggregate_train(1, replies)
    assert set(metrics.keys()) == {"epsilon", "delta", "noise-multiplier", "sample-rate", "rounds-released"}
    assert list(st.configure_evaluate(1, _global(), ConfigRecord(), FakeGrid(20))) == []
    assert st.aggregate_evaluate(1, []) is None


@pytest.mark.parametrize("inner", [FedAvgM(server_learning_rate=0.5, server_momentum=0.9), FedAdam(eta=0.1)])
def test_the_wrapped_strategy_is_the_server_optimizer(inner):
    """σ = 0: the wrapped strategy receives θ + Δ̃ and applies its own rule to Δ̃."""
    st = _wrapper(inner=inner, noise_multiplier=0.0, sample_rate=0.5)
    arrays = _global(1.0)
    msgs = list(st.configure_train(1, arrays, ConfigRecord(), FakeGrid(20)))
    new, _ = st.aggregate_train(1, _train_replies(msgs, scale=0.01))
    like = [np.zeros(s) for s in SHAPES.values()]
    ups = [[0.01 * _user_update(m.metadata.dst_node_id)[k].astype(np.float64) for k in SHAPES] for m in msgs]
    st2 = _wrapper(noise_multiplier=0.0, sample_rate=0.5)
    mean, _ = agg.aggregate_updates(st2.mechanism, st2.mechanism.clipping.init(like), agg.stack_updates(ups, like), noise=None)
    delta = np.concatenate([m_.ravel() for m_ in mean])
    got = _flat_record(new) - 1.0
    if isinstance(inner, FedAvgM):
        np.testing.assert_allclose(got, 0.5 * delta, rtol=1e-4, atol=1e-7)
    else:  # FedAdam's first step moves every coordinate by about eta·sign(Δ̃)
        assert np.all(np.sign(got) == np.sign(delta))
        assert not np.allclose(got, delta)


def test_weighted_clipped_denominator_round():
    st = _wrapper(noise_multiplier=0.0, estimator="clipped", weight_cap=10.0, min_total_weight=5.0, total_weight=20.0)
    arrays = _global()
    msgs = list(st.configure_train(1, arrays, ConfigRecord(), FakeGrid(20)))
    replies = []
    counts = []
    for i, m in enumerate(msgs):
        counts.append(3 + 4 * i)
        upd = _user_update(m.metadata.dst_node_id)
        replies.append(_reply(m, upd, num_examples=counts[-1]))
    new, _ = st.aggregate_train(1, replies)
    like = [np.zeros(s) for s in SHAPES.values()]
    ups = [[_user_update(m.metadata.dst_node_id)[k].astype(np.float64) for k in SHAPES] for m in msgs]
    w = st.mechanism.user_weights(counts, len(counts))
    mean, _ = agg.aggregate_updates(st.mechanism, st.mechanism.clipping.init(like), agg.stack_updates(ups, like),
                                    weights=w, noise=None)
    np.testing.assert_allclose(_flat_record(new), np.concatenate([m_.ravel() for m_ in mean]), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"strategy": "fedavg"}, "Flower Strategy"),
        ({"accountant": "rdp"}, "Accountant"),
        ({"delta": None}, "which delta"),
        ({"delta": 2.0}, "delta"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"sample_rate": 0.0}, "sample_rate"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    kw = {"clipping": FlatClipping(max_grad_norm=1.0), "noise_multiplier": 1.0, "sample_rate": 0.3,
          "num_users": 20, "delta": 1e-5}
    strategy = kwargs.pop("strategy", FedAvg())
    kw.update(kwargs)
    with pytest.raises(InvalidHyperparameterError, match=match):
        ServerSideClipping(strategy, **kw)


def test_aggregating_an_unconfigured_round_is_an_error():
    st = _wrapper()
    with pytest.raises(InvalidHyperparameterError, match="not configured"):
        st.aggregate_train(7, [])


# --------------------------------------------------------------------------- client side


def _run_mod(msg, train):
    """Call adaclip_mod on ``msg`` with an app that trains with ``train(theta) -> arrays``."""

    def call_next(inner, ctxt):
        assert set(inner.content.keys()) == {"arrays", "config"}  # the app sees a plain message
        theta = {k: a.numpy() for k, a in inner.content["arrays"].items()}
        out = train(theta)
        if isinstance(out, Exception):
            raise out
        return _reply(inner, out, num_examples=9)

    return adaclip_mod(msg, None, call_next)


@pytest.mark.parametrize("clipping", [FlatClipping(max_grad_norm=0.7), PerLayerClipping(max_grad_norm=0.7),
                                      AdaptiveClipping(std_min=0.01, std_max=1.0)])
def test_client_side_round_with_sigma_zero_equals_server_side(clipping):
    server = _wrapper(clipping=clipping, noise_multiplier=0.0, sample_rate=0.5, weight_cap=6.0)
    client = _wrapper(ClientSideClipping, clipping=clipping, noise_multiplier=0.0, sample_rate=0.5, weight_cap=6.0)
    a_server = a_client = _global()
    for rnd in (1, 2):
        ms = list(server.configure_train(rnd, a_server, ConfigRecord(), FakeGrid(20)))
        mc = list(client.configure_train(rnd, a_client, ConfigRecord(), FakeGrid(20)))
        assert [m.metadata.dst_node_id for m in ms] == [m.metadata.dst_node_id for m in mc]
        rs = []
        for m in ms:
            theta = {k: a.numpy() for k, a in m.content["arrays"].items()}
            upd = _user_update(m.metadata.dst_node_id)
            rs.append(_reply(m, {k: theta[k] + upd[k] for k in SHAPES}, num_examples=9))
        rc = [_run_mod(m, lambda th, node=m.metadata.dst_node_id: {k: th[k] + _user_update(node)[k] for k in SHAPES})
              for m in mc]
        a_server, _ = server.aggregate_train(rnd, rs)
        a_client, _ = client.aggregate_train(rnd, rc)
        np.testing.assert_allclose(_flat_record(a_client), _flat_record(a_server), rtol=1e-5, atol=1e-7)


def test_client_side_failures_send_only_noise_and_dropouts_are_made_up():
    """A failing app or a NaN model still replies (its noise share, nothing else); a user that
    never replies has its share made up by the server: the release carries σ² either way."""
    sigma = 1.5
    st = _wrapper(ClientSideClipping, noise_multiplier=sigma, sample_rate=0.5)
    msgs = list(st.configure_train(1, _global(), ConfigRecord(), FakeGrid(20)))
    n = len(msgs)
    assert msgs[0].content["adaclip.config"]["noise-std"] == pytest.approx(sigma / np.sqrt(n))
    failed = _run_mod(msgs[0], lambda th: RuntimeError("out of memory"))
    nan = _run_mod(msgs[1], lambda th: {k: np.full(SHAPES[k], np.nan, np.float32) for k in SHAPES})
    for r in (failed, nan):
        assert not r.has_error()
        assert set(r.content["metrics"].keys()) == {"num-examples"}
    assert agg.missing_share_noise_multiplier(sigma, n, 2) == pytest.approx(sigma * np.sqrt((n - 2) / n))
    st.aggregate_train(1, [failed, nan])
    assert st.accountant.steps == 1


def test_client_side_refuses_what_it_cannot_do():
    from adaclip import AutomaticClipping, QuantileClipping

    for clipping in (AutomaticClipping(max_grad_norm=1.0), QuantileClipping(max_grad_norm=1.0)):
        with pytest.raises(InvalidHyperparameterError, match="client-side"):
            _wrapper(ClientSideClipping, clipping=clipping)
    with pytest.raises(InvalidHyperparameterError, match="fixed"):
        _wrapper(ClientSideClipping, estimator="clipped")


def test_mod_passes_other_messages_through():
    msg = Message(content=RecordDict({"arrays": _global(), "config": ConfigRecord({})}), message_type="train", dst_node_id=5)
    out = adaclip_mod(msg, None, lambda m, c: _reply(m, {k: np.ones(s, np.float32) for k, s in SHAPES.items()}))
    np.testing.assert_array_equal(out.content["arrays"]["w"].numpy(), np.ones((3, 2)))


# --------------------------------------------------------------------------- canary audit


def _canary_audit(cls, sigma, *, noise_scale=1.0, m=500, rounds=5, q=0.5, seed=0):
    """One-run audit of a wrapper: m canary users, each in the population with probability ½;
    canary i's update is 10·e_i (clipped to e_i); score = Σ_t of coordinate i of the released
    mean update. ``noise_scale`` < 1 breaks the mechanism (less noise than accounted)."""
    from adaclip.audit.report import audit_scores

    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    grid = FakeGrid(m)
    present = [nid for nid, inc in zip(grid.ids, included) if inc]
    grid.ids = present
    index = {nid: i for i, nid in enumerate(FakeGrid(m).ids)}
    st = cls(FedAvg(), clipping=FlatClipping(max_grad_norm=1.0), noise_multiplier=sigma, sample_rate=q,
             num_users=m, delta=1e-5, seed=seed)
    if noise_scale != 1.0:  # the server's draws, and (client-side) the shares it asks for
        st._noise = _ScaledNormal(st._noise, noise_scale)
        share = agg.client_noise_std
        st._client_content = _with_patched(st._client_content, lambda s, n: noise_scale * share(s, n))
    arrays = ArrayRecord({"w": Array(np.zeros(m, np.float32))})
    scores = np.zeros(m)
    for rnd in range(1, rounds + 1):
        msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), grid))
        replies = []
        for msg in msgs:
            theta = msg.content["arrays"]["w"].numpy()
            bump = np.zeros(m, np.float32)
            bump[index[msg.metadata.dst_node_id]] = 10.0
            replies.append(_reply(msg, {"w": theta + bump}))
        if cls is ClientSideClipping:
            replies = [_run_mod(msg, lambda th, r=r: {"w": r.content["arrays"]["w"].numpy()}) for msg, r in zip(msgs, replies)]
        new, _ = st.aggregate_train(rnd, replies)
        scores += new["w"].numpy().astype(np.float64) - arrays["w"].numpy()
        arrays = new
    return audit_scores(scores, included, delta=1e-5, accountant_epsilon=st.epsilon, gdp=False)


def _with_patched(method, client_noise_std):
    def call(*args, **kwargs):
        saved = agg.client_noise_std
        agg.client_noise_std = client_noise_std
        try:
            return method(*args, **kwargs)
        finally:
            agg.client_noise_std = saved

    return call


class _ScaledNormal:
    """A generator whose normal draws are scaled down (a deliberately broken mechanism)."""

    def __init__(self, gen, scale):
        self.gen, self.scale = gen, scale

    def standard_normal(self, shape=None):
        return self.scale * self.gen.standard_normal(shape)


@pytest.mark.parametrize("cls", [ServerSideClipping, ClientSideClipping])
def test_canary_audit_stays_within_the_accountant_and_catches_too_little_noise(cls):
    sound = _canary_audit(cls, 4.0)
    assert not sound.exceeds_accountant, str(sound)
    broken = _canary_audit(cls, 4.0, noise_scale=0.02)
    assert broken.exceeds_accountant, str(broken)


def test_adaclip_warns_when_its_statistics_would_drift_on_the_noise():
    from adaclip.errors import NoiseDominatedWarning

    big = _wrapper(clipping=AdaptiveClipping(std_min=0.01, std_max=1.0), noise_multiplier=3.0, sample_rate=0.05)
    with pytest.warns(NoiseDominatedWarning):
        big.configure_train(1, _global(), ConfigRecord(), FakeGrid(20))
    import warnings

    flat = _wrapper(noise_multiplier=3.0, sample_rate=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoiseDominatedWarning)
        flat.configure_train(1, _global(), ConfigRecord(), FakeGrid(20))


# --------------------------------------------------------------------------- what was built


class _SilentGrid(FakeGrid):
    """A grid whose nodes never answer (the rounds release noise alone)."""

    def send_and_receive(self, messages, timeout=None):
        list(messages)
        return []


def _announcements(caplog):
    return [r for r in caplog.records if r.name == "adaclip_flower.server"]


def test_a_run_announces_what_was_built_once_through_logging(caplog):
    caplog.set_level(logging.INFO, logger="adaclip_flower.server")
    acc = Accountant("rdp", target_epsilon=8.0, delta=1e-5)
    st = _wrapper(inner=FedAvgM(server_learning_rate=1.0, server_momentum=0.5), noise_multiplier=1.3, sample_rate=0.25,
                  num_users=20, accountant=acc, delta=None, seed=None)
    st.start(grid=_SilentGrid(20), initial_arrays=_global(), num_rounds=3)
    records = _announcements(caplog)
    assert len(records) == 1 and records[0].levelno == logging.INFO  # not again at each round
    text = records[0].getMessage()
    planned = Accountant("rdp")
    planned.step(noise_multiplier=1.3, sample_rate=0.25, num_steps=3)
    for part in ("ServerSideClipping built user-level DP-FedAvg: independent noise (fresh every round), added once by "
                 "the server", "sigma = 1.3;", "clipping FlatClipping(max_grad_norm=1.0), clip norm 1 per user update",
                 "users Poisson-sampled every round at q = 0.25 of 20 (5 expected)", "estimator fixed (denominator 5)",
                 f"3 planned rounds, accounted as 3 compositions at rate 0.25; epsilon = {planned.epsilon(1e-5):.4g} at "
                 "delta = 1e-05 after them (rdp)", "budget epsilon = 8 at delta = 1e-05", "server optimizer FedAvgM",
                 "federated evaluation off"):  # fmt: skip
        assert part in text, (part, text)
    assert "seeded" not in text and "WARNING" not in text
    assert (st.planned_rounds, st.planned_compositions, st.accountant.steps) == (3, 3, 3)
    assert st.planned_epsilon() == pytest.approx(planned.epsilon(1e-5), rel=1e-12) == pytest.approx(st.epsilon)


def test_a_strategy_driven_by_hand_announces_at_its_first_round(caplog):
    caplog.set_level(logging.INFO, logger="adaclip_flower.server")
    st = _wrapper(noise_multiplier=0.9, sample_rate=0.3)
    arrays = _global()
    for rnd in (1, 2):
        msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), FakeGrid(20)))
        arrays, _ = st.aggregate_train(rnd, _train_replies(msgs))
    (record,) = _announcements(caplog)
    text = record.getMessage()
    assert "accounted as one composition every round at rate 0.3" in text and "planned" not in text
    assert "no budget (epsilon reported at delta = 1e-05)" in text
    assert "sampling and noise seeded (experiments only: a known seed predicts the noise)" in text
    assert st.planned_rounds is None and st.planned_compositions is None and st.planned_epsilon() is None


def test_client_side_announces_its_noise_shares(caplog):
    caplog.set_level(logging.INFO, logger="adaclip_flower.server")
    st = _wrapper(ClientSideClipping, noise_multiplier=0.9, sample_rate=0.3)
    st.configure_train(1, _global(), ConfigRecord(), FakeGrid(20))
    (record,) = _announcements(caplog)
    assert record.getMessage().startswith("ClientSideClipping built user-level DP-FedAvg: independent noise, in shares "
                                          "sigma/sqrt(n) added by the n sampled clients")  # fmt: skip


def test_the_announcement_warns_of_what_it_sets_aside_and_of_a_plan_beyond_the_budget(caplog):
    caplog.set_level(logging.INFO, logger="adaclip_flower.server")
    acc = Accountant("rdp", target_epsilon=3.0, delta=1e-5)
    st = _wrapper(inner=FedAvg(fraction_train=0.5), accountant=acc, noise_multiplier=2.0, sample_rate=0.3, delta=None)
    with pytest.raises(BudgetExceededError):
        st.start(grid=_SilentGrid(20), initial_arrays=_global(), num_rounds=50)
    (record,) = _announcements(caplog)
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "the wrapped FedAvg's fraction_train=0.5 is not used: users are Poisson-sampled at q = 0.3 instead" in text
    assert re.search(r"the 50 planned rounds would spend epsilon = [\d.]+ at delta = 1e-05, more than the budget of 3: "
                     r"the first round beyond it raises BudgetExceededError", text), text  # fmt: skip
    assert st.accountant.steps == 12 and st.epsilon <= 3.0  # the rounds that fit, then the refusal


def test_the_announcement_is_silent_when_its_logger_is_silenced(caplog):
    parent = logging.getLogger("adaclip_flower")
    saved = parent.level
    parent.setLevel(logging.ERROR)
    try:
        st = _wrapper(inner=FedAvg(fraction_train=0.5), noise_multiplier=0.9, sample_rate=0.3)
        st.configure_train(1, _global(), ConfigRecord(), FakeGrid(20))
    finally:
        parent.setLevel(saved)
    assert _announcements(caplog) == []


def test_rounds_spend_through_the_budget_keeper(monkeypatch):
    """Configure refuses early, aggregate checks again and writes ahead before the noisy aggregate
    exists, then records: the core's protocol (:mod:`adaclip.accounting.keeper`), in the
    wording every front end uses."""
    from adaclip.accounting import keeper

    calls = []
    for name in ("refuse", "write_ahead", "record"):
        original = getattr(keeper, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(keeper, name, spy)
    st = _wrapper(accountant=Accountant("rdp", target_epsilon=1.0, delta=1e-5), noise_multiplier=3.0,
                  sample_rate=0.3, delta=None)  # fmt: skip
    arrays = _global()
    msgs = list(st.configure_train(1, arrays, ConfigRecord(), FakeGrid(20)))
    st.aggregate_train(1, _train_replies(msgs))
    assert calls == ["refuse", "refuse", "write_ahead", "record"]
    with pytest.raises(BudgetExceededError, match=r"^round \d+ \(noise_multiplier=3\.0.*has released \d+ round\(s\)"):
        for rnd in range(2, 1000):
            msgs = list(st.configure_train(rnd, arrays, ConfigRecord(), FakeGrid(20)))
            arrays, _ = st.aggregate_train(rnd, _train_replies(msgs))
