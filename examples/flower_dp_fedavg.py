"""User-level DP-FedAvg on Flower: fine-tune a pretrained next-word LSTM across simulated users.

The setting of on-device language-model fine-tuning: a model pretrained on a *public* corpus is
fine-tuned on users whose text differs from it (other topics of the same synthetic language,
``benchmarks/federated/fed_tasks.py``, task ``lm-users``). Each round Flower's simulation engine
Poisson-samples users (q = users per round / users), each sampled user trains locally from the
global model, and :class:`adaclip_flower.ServerSideClipping` clips every user's model update
(flat clipping by default: the benchmark's winner at this scale, where AdaCliP's noise drift
number is far above 1 and ``ServerSideClipping`` warns), adds noise once, and applies the server
optimizer (FedAvgM). σ is calibrated so that the whole run spends the target user-level ε; the
script prints next-word accuracy on held-out users (the users' distribution) and on the public
distribution, before and after fine-tuning, and the ε the accountant reports.

The defaults are the configuration of ``benchmarks/federated/run.py`` (1,000 users, 20 per round,
50 rounds, 2 local epochs of batch 4, clip norms picked on validation users there). The server and
client apps are those of the Flower App ``examples/flower_app`` (run it with ``flwr run``, in
simulation or on a deployment); this script runs them in-process.

    python examples/flower_dp_fedavg.py                       # flat clipping, ε = 3
    python examples/flower_dp_fedavg.py --rehearsal 1         # keep the public distribution
    python examples/flower_dp_fedavg.py --clipping adaclip    # AdaCliP aggregation (lost here)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.simulation import run_simulation

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples" / "flower_app"), str(ROOT / "benchmarks" / "federated")]
from dp_fedavg.server_app import run  # noqa: E402
from dp_fedavg.task import DEFAULTS, build_client_app  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, default in DEFAULTS.items():
        kind = type(default)
        extra = {"choices": ["flat", "adaclip"]} if key == "clipping" else {}
        p.add_argument(f"--{key.replace('num-server-rounds', 'rounds')}", dest=key, type=kind, default=default, **extra)
    cfg = vars(p.parse_args())

    t0 = time.time()
    server = ServerApp()
    out = {}

    @server.main()
    def main_(grid: Grid, context: Context) -> None:
        out["summary"] = run(grid, cfg)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    run_simulation(server_app=server, client_app=build_client_app(cfg), num_supernodes=int(cfg["num-users"]),
                   backend_config={"client_resources": {"num_cpus": 1}})
    print(out["summary"], f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
