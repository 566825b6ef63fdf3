"""The same ServerApp and ClientApp on a real Flower deployment on loopback: a SuperLink and
three SuperNodes as separate processes, the app started with ``flwr run``. Every node is sampled
(q = 1) and σ = 0, so the final model must equal the in-process reference of client-side AdaCliP
clipping; the node config (partition ids) and the client mod work across processes.

The deployment is secure (TLS and SuperNode authentication, see _flower_deployment.py), and two
SuperNodes without a registered key start alongside: they are refused, and the run is exactly
the three authorised users' (a fourth or fifth user's update would change the model). The
``--insecure`` variant the docs keep for local testing runs with ``-m slow``. And the example
Flower App under ``flwr run`` on a simulation connection."""

import json
import pathlib
import re
import shutil

import numpy as np
import pytest

pytest.importorskip("flwr")
if shutil.which("flower-superlink") is None or shutil.which("flwr") is None:
    pytest.skip("the Flower CLI is not installed", allow_module_level=True)

import _flower_apps as apps  # noqa: E402
from _flower_deployment import INTRUDERS, run_app, run_app_in_simulation  # noqa: E402

from adaclip import AdaptiveClipping  # noqa: E402
from adaclip_flower import aggregation as agg  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
NODES, ROUNDS = 3, 2


def _run(tmp_path, **kwargs):
    out = tmp_path / "out" / "result.npz"
    result = run_app(ROOT / "tests" / "flower_app", tmp_path / "run", num_nodes=NODES,
                     run_config=f"num-server-rounds={ROUNDS} min-nodes={NODES} output-path='{out}'",
                     pythonpath=[str(ROOT), str(ROOT / "tests")], **kwargs)
    assert result.status == "finished:completed"
    return result, out


def _assert_equals_the_in_process_reference(out: pathlib.Path) -> None:
    """The final model is the 3-user in-process reference, and every round was accounted."""
    with np.load(out) as final:
        got = {k: final[k] for k in final.files}
    assert json.loads(out.with_suffix(".json").read_text()) == {"rounds-released": ROUNDS}

    theta = {k: v.detach().numpy() for k, v in apps.make_model().state_dict().items()}
    clipping = AdaptiveClipping(std_min=0.01, std_max=0.5)
    mech = agg.UserLevelMechanism(clipping=clipping, noise_multiplier=0.0, sample_rate=1.0, num_users=NODES)
    like = [np.zeros(v.shape) for v in theta.values()]
    state = clipping.init(like)
    for rnd in range(1, ROUNDS + 1):
        ups = [apps.local_update(u, theta, rnd) for u in range(NODES)]
        mean, state = agg.aggregate_updates(mech, state, agg.stack_updates(ups, like), noise=None)
        theta = {k: (v.astype(np.float64) + m).astype(np.float32) for (k, v), m in zip(theta.items(), mean)}
    assert set(got) == set(theta)
    for k in theta:
        np.testing.assert_allclose(got[k], theta[k], rtol=1e-5, atol=1e-6)


def test_secure_deployment_admits_only_registered_supernodes(tmp_path):
    """TLS + SuperNode authentication: the three registered nodes run the app as before; a node
    whose key was never registered and one without a key are refused and take no part."""
    result, out = _run(tmp_path, intruders=INTRUDERS)

    # The SuperLink activated exactly the registered nodes; nobody else got a node id.
    assert len(set(result.registered)) == NODES
    assert sorted(result.activated) == sorted(result.registered)

    # Each intruder was refused at its first Fleet call and exited (Flower's exit code 305).
    refusals = {"unregistered-key": ("2004", "[code: 2004] Failed to activate SuperNode."),
                "no-key": ("2001", "[code: 2001] SuperNode authentication is enabled.")}
    assert len(result.refused) == len(INTRUDERS)
    for name, (code, log) in result.refused.items():
        api_error, message = refusals[name.split("-", 1)[1]]
        assert code != 0, log
        assert "Failed to initialize the connection to the SuperLink." in log and message in log, log
        assert "Exit Code: 305" in log, log
        assert f"[ApiError:{api_error}]" in result.superlink_log

    # Every round sampled the three authorised nodes out of three available ...
    assert re.findall(r"configure_train: Sampled (\d+) nodes \(out of (\d+)\)", result.run_log) == [(str(NODES), str(NODES))] * ROUNDS
    # ... and the release and its accounting are those of the three users alone.
    _assert_equals_the_in_process_reference(out)


@pytest.mark.slow
def test_insecure_loopback_deployment_for_local_testing(tmp_path):
    """The docs' local-testing variant (``--insecure``, nodes register themselves)."""
    result, out = _run(tmp_path, secure=False)
    assert result.registered == [] and len(set(result.activated)) == NODES
    _assert_equals_the_in_process_reference(out)


def test_the_example_flower_app_runs_with_flwr_run_in_simulation(tmp_path):
    """examples/flower_app with `flwr run` on a simulation connection (Flower's current way),
    tiny: 20 users, 10 per round, 2 rounds; it must finish and report ε = 3 at the planned end."""
    out = run_app_in_simulation(
        ROOT / "examples" / "flower_app", tmp_path, num_supernodes=20,
        run_config="num-users=20 users-per-round=10.0 num-server-rounds=2 epsilon=3.0",
        pythonpath=[str(ROOT)],
    )
    assert re.search(r"test accuracy before (\d\.\d+) .*, after (\d\.\d+)", out), out[-4000:]
    found = re.search(r"user-level epsilon (\d\.\d+) at delta 1e-05 after 2 rounds", out)
    assert found, out[-4000:]
    assert float(found.group(1)) <= 3.0 and float(found.group(1)) > 2.9
