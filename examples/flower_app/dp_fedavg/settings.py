"""The run's settings: each key of the app's run config (``[tool.flwr.app.config]`` of
``pyproject.toml``), its default and what it means, and the ``--quick`` setting.

Plain Python without imports of Flower or PyTorch, so that ``examples/flower_dp_fedavg.py
--help`` answers at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The digits held out for the server's test set, and the training digits dealt out to the users.
NUM_TEST, NUM_TRAIN = 360, 1437

#: key: (default, help). The defaults are those of ``pyproject.toml`` (a test checks it).
SETTINGS: dict[str, tuple[Any, str]] = {
    "num-users": (300, "U: simulated users, one Flower SuperNode each; the 1,437 training digits are dealt out "
                       "among them (about 4.8 each at U = 300)"),
    "users-per-round": (60.0, "qU: expected users per round; each user joins a round independently with "
                              "probability q = users-per-round / num-users (Poisson sampling)"),
    "num-server-rounds": (20, "T: rounds; sigma is calibrated so that T rounds spend exactly epsilon"),
    "epsilon": (2.0, "user-level epsilon of the whole run: sigma's calibration target and the accountant's "
                     "budget (a round beyond it is refused)"),
    "delta": (1e-5, "delta of the guarantee and of the budget"),
    "clipping": ("flat", "how each user's model update is clipped: 'flat' (to clip-norm) or 'adaclip' "
                         "(AdaCliP's coordinate-wise scale, starting as flat clipping at clip-norm)"),
    "clip-norm": (1.0, "S: the clip norm of a user's model update (AdaCliP: the initial one)"),
    "client-lr": (0.5, "learning rate of the users' local SGD"),
    "epochs": (2, "E: local epochs over the user's own digits each round"),
    "batch-size": (8, "local minibatch size"),
    "server-lr": (1.0, "server learning rate (FedAvgM applies the released mean update with it)"),
    "server-momentum": (0.0, "server momentum (FedAvgM)"),
    "seed": (0, "seeds the initial model, the users' shuffling and the server's sampling and noise "
                "(experiments only: a known seed predicts the noise). Flower numbers the simulated nodes at "
                "random in each run, so which users join which round still changes from run to run"),
}

#: The defaults alone.
DEFAULTS: dict[str, Any] = {key: default for key, (default, _) in SETTINGS.items()}

#: ``--quick``: 100 users (about 14 digits each), 30 per round, 5 rounds, at the same epsilon.
QUICK: dict[str, Any] = {"num-users": 100, "users-per-round": 30.0, "num-server-rounds": 5}


def settings(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults overridden by the run config (keys it does not know are ignored)."""
    out = dict(DEFAULTS)
    out.update({k: v for k, v in run_config.items() if k in DEFAULTS})
    return out
