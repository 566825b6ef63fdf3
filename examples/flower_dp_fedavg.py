"""User-level DP-FedAvg on Flower: fine-tune a pretrained next-word LSTM across simulated users.

The defaults are the configuration of ``benchmarks/federated/run.py`` (1,000 users, 20 per round,
50 rounds, 2 local epochs of batch 4, clip norms picked on validation users there). The setting of on-device language-model fine-tuning: a model pretrained on a *public* corpus is
fine-tuned on users whose text differs from it (other topics of the same synthetic language,
``benchmarks/federated/fed_tasks.py``, task ``lm-users``). Each round Flower's simulation engine
Poisson-samples users (q = users per round / users), each sampled user trains locally from the
global model, and :class:`adaclip_flower.ServerSideClipping` clips every user's model update
(flat clipping by default: the benchmark's winner at this scale, where AdaCliP's noise drift
number is far above 1 and ``ServerSideClipping`` warns), adds noise once, and applies the server
optimizer (FedAvgM). σ is
calibrated so that the whole run spends the target user-level ε; the script prints next-word
accuracy on held-out users (the users' distribution) and on the public distribution, before and
after fine-tuning, and the ε the accountant reports.

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
from flwr.serverapp.strategy import FedAvgM
from flwr.simulation import run_simulation

from adaclip import AdaptiveClipping, FlatClipping
from adaclip.accounting import Accountant, calibrate_noise_multiplier
from adaclip_flower import ServerSideClipping
from adaclip_flower.torch_client import client_app, load_model_arrays, model_arrays

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "federated"))
from fed_tasks import load_federated_task, pretrain  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--users-per-round", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clipping", choices=["flat", "adaclip"], default="flat")
    p.add_argument("--clip-norm", type=float, default=None,
                   help="S (AdaCliP starts as flat clipping at S); default: the benchmark's pick, 0.1 AdaCliP, 0.4 flat")
    p.add_argument("--client-lr", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--server-momentum", type=float, default=0.0)
    p.add_argument("--rehearsal", type=float, default=0.0, help="ρ: public examples per own example (0: off)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    t0 = time.time()
    task = load_federated_task("lm-users", num_users=args.users)
    model = pretrain(task, task.make_model(args.seed), seed=args.seed, **task.pretrain_defaults)
    initial = model_arrays(model)
    print(f"pretrained on public data: next-word accuracy users {task.metric(model, *task.test_user):.3f}, "
          f"public {task.metric(model, *task.test_public):.3f}")

    q = args.users_per_round / args.users
    sigma = calibrate_noise_multiplier(target_epsilon=args.epsilon, delta=args.delta, sample_rate=q, steps=args.rounds)
    d = sum(v.numel() for v in model.parameters())
    clip = args.clip_norm if args.clip_norm is not None else (0.1 if args.clipping == "adaclip" else 0.4)
    clipping = (AdaptiveClipping.from_initial_clip(clip, num_params=d) if args.clipping == "adaclip"
                else FlatClipping(max_grad_norm=clip))
    strategy = ServerSideClipping(
        FedAvgM(server_learning_rate=args.server_lr, server_momentum=args.server_momentum),
        clipping=clipping, noise_multiplier=sigma, sample_rate=q, num_users=args.users,
        accountant=Accountant("rdp", target_epsilon=args.epsilon, delta=args.delta), seed=args.seed,
    )
    public = task.public if args.rehearsal > 0 else None
    clients = client_app(lambda: task.make_model(0), lambda ctx: task.user_data(int(ctx.node_config["partition-id"])),
                         epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.client_lr,
                         loss_fn=task.loss_fn, public=public, rehearsal_fraction=args.rehearsal, seed=args.seed)

    server = ServerApp()

    @server.main()
    def run(grid: Grid, context: Context) -> None:
        result = strategy.start(grid=grid, initial_arrays=initial, num_rounds=args.rounds)
        load_model_arrays(model, result.arrays)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    run_simulation(server_app=server, client_app=clients, num_supernodes=args.users,
                   backend_config={"client_resources": {"num_cpus": 1}})
    print(f"DP-FedAvg, {args.clipping} aggregation, {args.rounds} rounds, q = {q:.3f}, sigma = {sigma:.3f}, "
          f"rehearsal = {args.rehearsal}")
    print(f"fine-tuned: next-word accuracy users {task.metric(model, *task.test_user):.3f}, "
          f"public {task.metric(model, *task.test_public):.3f}")
    print(f"user-level epsilon = {strategy.epsilon:.3f} at delta = {args.delta:g} "
          f"({strategy.accountant.steps} rounds); {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
