"""PyTorch clients: local training, random rehearsal, the ClientApp's reply."""

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from adaclip.errors import InvalidHyperparameterError  # noqa: E402
from adaclip_flower import torch_client as tc  # noqa: E402


def _data(n, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g) + offset
    return x, (x[:, 0] > offset).long()


@pytest.mark.parametrize("rho,n,public_n,expected", [(0.0, 10, 50, 10), (0.5, 10, 50, 15), (1.0, 7, 50, 14),
                                                     (0.25, 10, 50, 13), (3.0, 10, 20, 30)])
def test_rehearsal_adds_ceil_rho_n_public_examples(rho, n, public_n, expected):
    x, y = _data(n)
    px, py = _data(public_n, offset=100.0)
    mx, my = tc.rehearsal_mix(x, y, (px, py), rho, torch.Generator().manual_seed(0))
    assert len(mx) == len(my) == expected
    assert torch.equal(mx[:n], x)  # the user's own examples all stay
    extra = mx[n:]
    assert (extra > 50).all()  # the rest are public, distinct draws
    assert len({tuple(r.tolist()) for r in extra}) == len(extra)


def test_rehearsal_without_public_data_or_user_data_is_a_no_op():
    x, y = _data(5)
    assert tc.rehearsal_mix(x, y, None, 1.0)[0] is x
    empty = (x[:0], y[:0])
    assert len(tc.rehearsal_mix(*empty, _data(5), 1.0)[0]) == 0


def test_local_training_is_seeded_and_moves_the_model():
    x, y = _data(12)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        before = [p.detach().clone() for p in model.parameters()]
        loss = tc.train_locally(model, x, y, epochs=3, batch_size=4, learning_rate=0.5,
                                generator=torch.Generator().manual_seed(1))
        assert np.isfinite(loss)
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_fedsgd_is_one_full_batch_step():
    """E = 1 with a batch as large as the data: exactly θ − η∇L(θ) on the user's data."""
    x, y = _data(9)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    tc.train_locally(model, x, y, epochs=1, batch_size=100, learning_rate=0.3)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), (r - 0.3 * r.grad).detach())


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_local_training_is_torch_sgd_bit_for_bit(momentum):
    """train_locally's written-out step (no torch.optim: it imports torch._dynamo, seconds per
    process) is torch.optim.SGD's, to the bit, with and without momentum; a frozen parameter
    stays as it is."""
    x, y = _data(23)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model[0].bias.requires_grad_(False)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    ref.load_state_dict(model.state_dict())
    ref[0].bias.requires_grad_(False)
    loss = tc.train_locally(model, x, y, epochs=3, batch_size=5, learning_rate=0.3, momentum=momentum,
                            generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=momentum)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        order, total = torch.randperm(len(x), generator=g), 0.0
        for start in range(0, len(x), 5):
            idx = order[start:start + 5]
            opt.zero_grad()
            batch_loss = torch.nn.functional.cross_entropy(ref(x[idx]), y[idx])
            batch_loss.backward()
            opt.step()
            total += float(batch_loss.detach()) * len(idx)
    assert loss == total / len(x)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs", [{"epochs": 0}, {"epochs": 1.5}, {"batch_size": 0}, {"learning_rate": -1.0},
                                    {"learning_rate": float("nan")}, {"momentum": -0.1}, {"rehearsal_fraction": -1.0},
                                    {"epochs": True}])
def test_bad_training_arguments_are_refused_before_anything_changes(kwargs):
    x, y = _data(4)
    model = torch.nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InvalidHyperparameterError):
        tc.train_locally(model, x, y, **kwargs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_client_app_replies_with_the_trained_model_and_the_users_own_count():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 2)

    app = tc.client_app(make_model, lambda ctx: _data(6, seed=int(ctx.node_config["partition-id"])), epochs=1,
                        batch_size=3, learning_rate=0.1, public=_data(40, offset=3.0), rehearsal_fraction=1.0, seed=2)
    arrays = tc.model_arrays(make_model())
    msg = Message(content=RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})}),
                  message_type="train", dst_node_id=1)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 3}, state=RecordDict(), run_config={})
    reply = app(msg, ctx)
    assert reply.content["metrics"]["num-examples"] == 6  # rehearsal examples do not count
    trained = reply.content["arrays"]
    assert isinstance(trained, ArrayRecord) and list(trained.keys()) == list(arrays.keys())
    assert not np.allclose(trained["weight"].numpy(), arrays["weight"].numpy())
    again = app(msg, ctx)
    np.testing.assert_array_equal(again.content["arrays"]["weight"].numpy(), trained["weight"].numpy())
