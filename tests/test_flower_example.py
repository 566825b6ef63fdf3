"""The Flower example, ``examples/flower_dp_fedavg.py`` with the Flower App ``examples/flower_app``.

- ``--quick`` runs the app with ``flwr run`` on a SuperLink of its own (once for the module,
  with Python's warnings shown in every process): the users learn (test accuracy from chance
  to well above it), the run spends the target ε and says so, the strategy announces what it
  built once, nothing prints a deprecation warning, and nothing is left running;
- ``--help`` describes the example and gives every option a text;
- in this process, with the app's own strategy and clients on a grid that calls the ClientApp
  directly: the announcement is one ``adaclip_flower.server`` log record with the mechanism, σ,
  the planned compositions and ε, and nothing more when the logger is silenced;
- the app's run-config defaults are those of ``settings.py``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("flwr")
pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flower_dp_fedavg.py"
APP = ROOT / "examples" / "flower_app"
NUM = r"(\d+\.\d+)"


def _example():
    spec = importlib.util.spec_from_file_location("flower_dp_fedavg_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts examples/flower_app on sys.path (for dp_fedavg)
    return module


def _processes_with(marker: bytes) -> list[str]:
    """The live processes whose environment holds ``marker`` (Linux)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError):
                continue
            if marker in environ and state not in ("Z", "X"):
                out.append(cmd)
    return out


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One ``--quick`` run, with warnings shown in every process (``-W default`` for the
    script, ``PYTHONWARNINGS=default`` for the Flower processes it starts), and a mark in the
    environment that every process it starts inherits."""
    marker = f"flower-example-{os.getpid()}-{id(tmp_path_factory)}"
    env = dict(os.environ, PYTHONWARNINGS="default", ADACLIP_TEST_MARK=marker)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([sys.executable, "-W", "default", str(EXAMPLE), "--quick"], capture_output=True, text=True,
                          env=env, cwd=tmp_path_factory.mktemp("cwd"), timeout=300, check=False)  # fmt: skip
    return done, f"ADACLIP_TEST_MARK={marker}".encode()


def test_quick_run_learns_within_the_budget_and_says_what_it_built(quick):
    done, _ = quick
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    found = re.search(rf"test accuracy before {NUM} .*, after {NUM}", out)
    assert found, out[-6000:]
    before, after = float(found.group(1)), float(found.group(2))
    assert before < 0.2  # the random initial model: chance is 0.1
    assert after > 0.45 and after > before + 0.3, out[-3000:]
    spent = re.search(rf"user-level epsilon {NUM} at delta 1e-05 after 5 rounds \(target 2\)", out)
    assert spent and 1.9 < float(spent.group(1)) <= 2.0, out[-3000:]
    # the strategy's announcement, once, with the mechanism, sigma and epsilon
    announced = [line for line in out.splitlines() if "adaclip_flower.server" in line]
    assert len(announced) == 1, announced
    assert "ServerSideClipping built user-level DP-FedAvg: independent noise" in announced[0]
    assert re.search(r"sigma = 1\.84\d?;", announced[0]) and "q = 0.3 of 100" in announced[0]
    assert re.search(r"5 planned rounds, accounted as 5 compositions at rate 0\.3; epsilon = (2|1\.99\d*) at "
                     r"delta = 1e-05", announced[0]), announced[0]  # fmt: skip
    assert re.search(r"\(\d+ s\)\s*$", done.stdout)  # the run time, last


def test_quick_run_prints_no_deprecation_warning_and_leaves_nothing_running(quick):
    done, marker = quick
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    deprecated = [line for line in out.splitlines() if "deprecat" in line.lower()]
    assert deprecated == [], "\n".join(deprecated)
    assert "FutureWarning" not in out  # Ray's, about the accelerator variable: opted in to
    assert _processes_with(marker) == []  # the SuperLink, SuperExec, simulation and Ray are gone


def test_help_describes_the_example_and_every_option():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60,
                          check=True)  # fmt: skip
    out = done.stdout
    assert "User-level DP-FedAvg on Flower" in out and "--quick" in out and "epsilon" in out
    parser = _example().build_parser()
    formatter = parser._get_formatter()
    actions = [a for a in parser._actions if a.option_strings]
    assert {"--quick", "--num-users", "--users-per-round", "--rounds", "--epsilon", "--delta", "--seed"} <= {
        s for a in actions for s in a.option_strings}
    listing = out.split("options:", 1)[1]
    for action in actions:
        assert action.help and action.help.strip(), action.option_strings
        invocation = formatter._format_action_invocation(action)
        # the option's entry in the listing: its invocation, then text (same line or the next)
        entry = re.search(rf"^  {re.escape(invocation)}(.*?)(?=^  -|\Z)", listing, re.M | re.S)
        assert entry and entry.group(1).strip(), f"no help text for {invocation}"


def test_quick_sets_the_small_setting_and_explicit_options_win():
    example = _example()
    cfg, args = example.parse_args(["--quick", "--epsilon", "4"])
    assert (cfg["num-users"], cfg["users-per-round"], cfg["num-server-rounds"], cfg["epsilon"]) == (100, 30.0, 5, 4.0)
    cfg, _ = example.parse_args(["--quick", "--rounds", "3"])
    assert cfg["num-server-rounds"] == 3
    cfg, _ = example.parse_args([])
    assert cfg == example.DEFAULTS
    assert example.run_config({"clipping": "flat", "num-users": 3, "delta": 1e-05}) == (
        'clipping="flat" num-users=3 delta=1e-05')
    with pytest.raises(SystemExit):
        example.parse_args(["--num-users", "2000"])


def test_the_app_defaults_are_the_settings():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: Flower's own dependency
        import tomli as tomllib
    example = _example()
    config = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert config == example.DEFAULTS


# --------------------------------------------------------------------------- in this process


class _InProcessGrid:
    """What ``Strategy.start`` asks of a grid, answered by calling the ClientApp in this process
    (node ``100 + k`` is user ``k``)."""

    def __init__(self, client_app, num_users: int):
        self.client_app = client_app
        self.nodes = {100 + k: k for k in range(num_users)}

    def get_node_ids(self):
        return list(self.nodes)

    def send_and_receive(self, messages, timeout=None):
        from flwr.app import Context, RecordDict

        return [self.client_app(m, Context(run_id=1, node_id=m.metadata.dst_node_id, state=RecordDict(),
                                           node_config={"partition-id": self.nodes[m.metadata.dst_node_id]},
                                           run_config={}))
                for m in messages]  # fmt: skip


def _app_strategy(**overrides):
    _example()
    from dp_fedavg import task

    cfg = task.settings({**task.DEFAULTS, "num-users": 40, "users-per-round": 20.0, "num-server-rounds": 2, **overrides})
    model = task.make_model(0)
    strategy = task.build_strategy(cfg, sum(p.numel() for p in model.parameters()))
    return task, cfg, model, strategy


@pytest.mark.usefixtures("flower_task_identity")
def test_the_apps_strategy_announces_once_with_mechanism_sigma_and_epsilon(caplog):
    from adaclip_flower.torch_client import model_arrays

    task, cfg, model, strategy = _app_strategy()
    caplog.set_level(logging.INFO, logger="adaclip_flower.server")
    grid = _InProcessGrid(task.build_client_app(cfg), 40)
    result = strategy.start(grid=grid, initial_arrays=model_arrays(model), num_rounds=2)
    records = [r for r in caplog.records if r.name == "adaclip_flower.server"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    text = records[0].getMessage()
    assert text.startswith("ServerSideClipping built user-level DP-FedAvg: independent noise (fresh every round)")
    assert f"sigma = {strategy.noise_multiplier:.4g};" in text and "clip norm 1 per user update" in text
    assert "users Poisson-sampled every round at q = 0.5 of 40 (20 expected)" in text
    planned = re.search(r"2 planned rounds, accounted as 2 compositions at rate 0\.5; epsilon = ([\d.]+) at delta = "
                        r"1e-05 after them \(pld\)", text)  # fmt: skip
    assert planned and float(planned.group(1)) == pytest.approx(2.0, abs=1e-3), text
    assert "budget epsilon = 2 at delta = 1e-05" in text and "server optimizer FedAvgM" in text
    assert "seed=" not in text and "sampling and noise seeded (experiments only" in text  # never the seed itself
    assert strategy.accountant.steps == 2 and strategy.epsilon == pytest.approx(2.0, abs=1e-3)
    assert (strategy.planned_rounds, strategy.planned_compositions, strategy.bands) == (2, 2, 1)
    assert (strategy.noise_mechanism, strategy.clip_norm, strategy.sample_rate, strategy.num_users) == (
        "independent", 1.0, 0.5, 40)
    assert np.isfinite(np.concatenate([a.numpy().ravel() for a in result.arrays.values()])).all()


def test_the_announcement_is_silent_when_the_logger_is_silenced(caplog):
    _, _, _, strategy = _app_strategy()
    parent = logging.getLogger("adaclip_flower")
    saved = parent.level
    parent.setLevel(logging.ERROR)
    try:
        strategy.planned_rounds = 2
        strategy.announce()
    finally:
        parent.setLevel(saved)
    assert [r for r in caplog.records if r.name.startswith("adaclip_flower")] == []


def test_the_app_reads_the_digits_that_scikit_learn_loads():
    sklearn = pytest.importorskip("sklearn.datasets")
    _example()
    from dp_fedavg import task

    x, y = task._load_digits()
    xs, ys = sklearn.load_digits(return_X_y=True)
    np.testing.assert_array_equal(x, xs)
    np.testing.assert_array_equal(y, ys)
    x_train, _, x_test, _ = task.digits()
    assert (len(x_train), len(x_test)) == (1437, 360) and float(x_train.max()) == 1.0
    users = [task.user_data(k, 300)[1] for k in range(300)]
    assert sum(len(u) for u in users) == 1437 and min(len(u) for u in users) == 4


def test_the_launcher_imports_neither_flower_nor_torch():
    """Its --help answers at once; Flower runs in the processes it starts."""
    code = (f"import runpy, sys\nsys.argv = [{str(EXAMPLE)!r}, '--help']\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('flwr', 'torch', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
