"""Utility benchmark, round three: correlated (banded) noise and parameter averaging against
tuned DP-SGD, PyTorch, on the round-two tasks (example level) and the first round's MLP tasks.

One command per (task, inner optimizer, ε), from the repository root::

    python benchmarks/utility/round3.py --task mnist1d-long --optimizer sgd --epsilons 3 --seeds 3 --threads 1
    python benchmarks/utility/round3.py --report benchmarks/results/round3_*.json

Methods (flat clipping unless said; :data:`METHODS`):

- ``flat``: DP-SGD (``DPOptimizer`` with ``FlatClipping(C)``, independent noise, Poisson
  sampling), tuned over the task's lr × C grid of round two (:func:`round2.grid`): the baseline.
- ``flat+ema``: the same runs evaluated on an EMA of the parameters (the library's averaging,
  warm-up ``(1+t)/(10+t)``); μ ∈ {0.9, 0.99, 0.999} is picked on validation with lr and C. The
  average is post-processing of the releases, so one training run serves ``flat`` and all three μ.
- ``banded``: amplified banded matrix factorisation (``noise_mechanism=BandedNoise(c)``,
  ``CyclicPoissonBatchSampler``), b chosen before training by the library's rule (what
  ``make_private(noise_mechanism="banded", bands=None)`` does: :func:`choose_bands` over
  :data:`adaclip.correlated.planning.BAND_CANDIDATES` with σ_b calibrated for ⌈T/b⌉ compositions at
  rate b·q, square-root coefficients, the momentum workload with β = 0.9 for SGD-momentum and
  Adam alike) and the same lr × C grid. ``--bands-grid 4 16`` adds ``banded-grid``: b tuned
  as a third grid axis (a larger budget: flagged in the tables).
- ``banded+ema``: the banded runs evaluated on their EMA (μ picked on validation).
- ``quantile`` (Andrew et al.'s rule, ``C_0 = C``, γ = 0.5, round two's configuration) and
  ``per-layer`` (``C_k = C/√K``): the other baselines a practitioner has, on the same grid,
  independent noise; with ``flat`` they are :data:`BASELINES`.
- ``recommended``: the banded runs at the library's b, with the averaging picked on validation
  among no averaging and μ ∈ {0.9, 0.99, 0.999} (post-processing, so the runs are shared with
  ``banded``): what the docs recommend. The report adds its reading against the best baseline
  of the cell (U1: ahead if Δ ≥ 2 SE).
- ``banded-lr`` / ``recommended-lr``: ``banded`` / ``recommended`` with an adaptive
  optimizer's (Adam's) learning rate multiplied by ``ρ = σ_b·√v̄/σ_1``
  (:func:`adaclip.correlated.coefficients.adaptive_lr_scale`: Adam divides by a noise-dominated
  second moment, which banded noise inflates by ``ρ²``), on the same grid of lr (the table shows
  the grid's lr; the run trains at ``ρ·lr``); ``ρ = 1`` with SGD. A rule fixed before training
  from public quantities; it costs the same grid. ``banded-lr-nocap`` / ``recommended-lr-nocap``:
  the same, with b chosen by the expected-error rule without Adam's cap of
  ``ADAPTIVE_OPTIMIZER_MAX_BANDS`` bands (as for SGD).
- ``quantile-banded`` / ``recommended-quantile``: the quantile rule's clipping (as ``quantile``)
  with the noise plan of ``banded-lr-nocap`` (banded noise at the rule's b, Adam's learning rate
  times ρ), read live / with the averaging picked on validation as ``recommended``. The report
  adds U1 for the recommended configuration with its clipping picked on validation between this
  and the flat-clipping one (:func:`methods_round3.pick_clipping`; twice the grid).
- ``adaclip+banded+ema``: ``AdaClip`` (default preset, ``max_grad_norm = C``) with banded noise
  at the same b, evaluated on its EMA; ``adaclip+ema``: the same with independent noise (b = 1).
- ``blt`` / ``blt+ema``: BLT correlated noise (``noise_mechanism=BltNoise``, flat clipping) over
  fixed-order batches (``FixedOrderBatchSampler``: one seeded shuffle, then b = ⌈N/B⌉ batches
  an epoch, T = epochs·b), planned as ``make_private(noise_mechanism="blt")`` plans it
  (:func:`plan_blt`: the default number of buffers, the factor fitted for (T, b), σ calibrated
  for the min-separation, **unamplified** accounting), on the same lr × C grid; ``blt+ema``
  reads their EMA. The accounting assumes the fixed order is data-independent; it gets no
  amplification by sampling, so σ is much larger than ``flat``'s and the comparison is of
  what each mechanism buys at the same (ε, δ). Torch only.

Protocol per (task, optimizer, ε), as round two's: every configuration trains on the training
set minus a 20 % validation split with ``--tune-seeds`` seeds (1000 + s); the best validation
mean wins; winners are retrained on the whole training set with seeds 0..S−1 and scored once on
the test split. Within a seed every method shares the model initialisation, the sampler's
generator seed (``seed + 1``: with b = 1 the cyclic sampler draws exactly Poisson sampling's
batches) and the noise seed, so Δ vs tuned ``flat`` is paired. q = B̄/N, T = epochs·round(1/q),
δ = 1e-5; σ is RDP-calibrated per method for its own event (b = 1: T compositions at q).

``--framework jax`` trains each run with ``adaclip_jax`` instead (:mod:`round3_jax`, MLP tasks).

Output: ``benchmarks/results/round3_<task>_<framework>_<optimizer>_eps<ε>.json``; ``--report`` (the same
as ``report_round3.py FILES``) prints the tables of ``benchmarks/results/utility_round3.md``. The
methods are :mod:`methods_round3`'s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from calibration import calibrated_sigma  # noqa: E402
from methods_round3 import (  # noqa: E402,F401  (re-exported: tests use them from here)
    BASELINES,
    DECAYS,
    DEFAULT_METHODS,
    METHODS,
    RUN_OF,
    averaging_candidates,
    pick_winner,
    uses_ema,
)
from report_round3 import paired, report, u1_reading, verdict  # noqa: E402,F401  (re-exported)
from round2 import grid, load, trainable  # noqa: E402
from run import machine, summarise, versions  # noqa: E402
from tasks_round2 import ROUND2_TASKS  # noqa: E402
from tasks_round3 import BASE, ROUND3_TASKS, load_round3_task  # noqa: E402
from utility_tasks import TASKS, Task, split_validation  # noqa: E402
from utility_train import OPTIMIZERS, evaluate, make_optimizer, task_loss  # noqa: E402

import adaclip.accounting as accounting  # noqa: E402
from adaclip.averaging import AveragingConfig  # noqa: E402
from adaclip.correlated import BandedNoise, BltNoise  # noqa: E402
from adaclip.correlated import coefficients as band_coefficients  # noqa: E402
from adaclip.correlated.mechanism import accounted_sample_rate  # noqa: E402
from adaclip.errors import NoiseDominatedWarning  # noqa: E402

RESULTS = HERE.parent / "results"
DELTA = 1e-5


# --------------------------------------------------------------------------- noise plan


def plan_noise(
    task: Task,
    n_units: int,
    epochs: int,
    epsilon: float,
    optimizer: str,
    bands: int | None,
    *,
    run_kind: str = "banded",
) -> dict[str, Any]:
    """q, T, b, σ and the band coefficients of one run, from public quantities only.

    ``bands=None``: the library's choice (as ``make_private(noise_mechanism="banded",
    bands=None)``), ``choose_bands`` over the candidates ``b·q <= 1, b <= T`` with σ_b
    calibrated for ``⌈T/b⌉`` compositions at rate ``min(1, b·q)``; ``bands=1``: DP-SGD.
    ``run_kind="blt"``: :func:`plan_blt` (``bands`` is ignored)."""
    from adaclip.correlated.planning import candidate_bands
    from adaclip_torch.data import sample_rate_for, steps_per_epoch

    if run_kind == "blt":
        return plan_blt(task, n_units, epochs, epsilon)
    q = sample_rate_for(task.batch_size, n_units)
    total = epochs * steps_per_epoch(q)
    adaptive = optimizer == "adam"  # Adam divides by a running second moment

    def sigma_for(b: int) -> float:
        return calibrated_sigma(target_epsilon=epsilon, delta=DELTA, sample_rate=accounted_sample_rate(q, b),
                                steps=-(-total // b), accountant=ACCOUNTANT)

    table = None
    if bands is None:
        # SGD(momentum=0.9) and Adam (β1 = 0.9) both integrate the releases with a momentum 0.9
        # (adaclip_torch.privacy._workload_of); make_private's default coefficients are "sqrt".
        # Adam (an adaptive optimizer) gets at most ADAPTIVE_OPTIMIZER_MAX_BANDS bands, as in make_private.
        lr_scaled = run_kind in ("banded-lr-nocap", "quantile-banded")
        candidates = candidate_bands(sample_rate=q, steps=total, adaptive_optimizer=adaptive, lr_scaled=lr_scaled)
        bands, full = band_coefficients.choose_bands(candidates=candidates, n=total, sigma_for_bands=sigma_for,
                                                     workload="momentum", momentum=0.9, optimise=False)  # fmt: skip
        table = {str(b): {"sigma": s, "error": e} for b, (s, e, _) in full.items()}
    coefficients = band_coefficients.sqrt_toeplitz_coefficients(bands)
    lr_scale = 1.0
    if run_kind in ("banded-lr", "banded-lr-nocap", "quantile-banded") and adaptive:
        lr_scale = band_coefficients.adaptive_lr_scale(coefficients, total, sigma=sigma_for(bands),
                                                       sigma_independent=sigma_for(1))  # fmt: skip
    return {"lr_scale": lr_scale, "q": q, "steps": total, "per_epoch": steps_per_epoch(q), "bands": int(bands), "sigma": sigma_for(bands), "rate": accounted_sample_rate(q, bands),
            "coefficients": [float(c) for c in coefficients], "choice": table, "accountant": ACCOUNTANT}  # fmt: skip


def plan_blt(task: Task, n_units: int, epochs: int, epsilon: float) -> dict[str, Any]:
    """The BLT plan of one run, as ``make_private(noise_mechanism="blt", epochs=E,
    target_epsilon=ε)`` makes it (its calls, in its order): fixed-order batches of
    ``B = round(q·N)`` (``q = B̄/N``), ``b = ⌈N/B⌉`` batches an epoch, ``T = E·b`` steps; the
    factor ``fit_blt(T, buffers=DEFAULT_BLT_BUFFERS, min_separation=b)``; σ the smallest whose
    block-by-block record (one Gaussian event at rate 1 per epoch-long block, noise multiplier
    ``σ/√(S(t_1) − S(t_0))`` from the min-separation prefix sensitivities ``S``) meets
    ``(ε, δ)`` under RDP (``calibrate_block_noise_multiplier``).

    Privacy unit and assumptions: an example takes part in at most ``⌈T/b⌉`` steps, any two
    exactly ``b`` apart, because the order is shuffled once and then fixed. The accounting
    holds only if that order is data-independent (here: a seeded permutation of the indices,
    drawn before training) and it claims **no amplification** by sampling — the batches are
    not random after the shuffle — unlike ``flat`` and ``banded``, whose σ is calibrated for
    Poisson / cyclic Poisson sampling. ``bands`` in the plan is ``b`` (the min separation, as
    a banded run's ``b`` is its cycle), ``buffers`` is ``m``; ``theta``/``omega`` rebuild the
    :class:`~adaclip.correlated.BltNoise`."""
    from adaclip.correlated.blt import DEFAULT_BLT_BUFFERS, fit_blt
    from adaclip_torch.data import sample_rate_for

    batch_size = round(sample_rate_for(task.batch_size, n_units) * n_units)  # make_private's loader's B
    b = -(-n_units // batch_size)
    total = epochs * b
    noise = fit_blt(total, buffers=DEFAULT_BLT_BUFFERS, min_separation=b)
    prefix = accounting.MinSeparationParticipation(b).prefix_sensitivities_squared(noise.column(total))
    sigma = accounting.calibrate_block_noise_multiplier(target_epsilon=epsilon, delta=DELTA, prefix=prefix, block=b,
                                                        accountant=ACCOUNTANT)  # fmt: skip
    return {"mechanism": "blt", "q": batch_size / n_units, "batch_size": batch_size, "steps": total, "per_epoch": b,
            "bands": b, "buffers": noise.buffers, "theta": list(noise.theta), "omega": list(noise.omega),
            "sigma": sigma, "rate": 1.0, "coefficients": None, "choice": None, "accountant": ACCOUNTANT}  # fmt: skip


# --------------------------------------------------------------------------- one run


def build_private(
    run_kind: str,
    model: torch.nn.Module,
    inner: torch.optim.Optimizer,
    clip: float,
    plan: dict[str, Any],
    *,
    epsilon: float,
    seed: int,
    n_units: int,
    user_ids: torch.Tensor | None = None,
) -> tuple[Any, Any]:
    """(private optimizer, sampler) for a training run of kind ``flat``, ``banded``,
    ``banded-grid``, ``adaclip``, ``adaclip-banded``, ``quantile``, ``per-layer`` or ``blt``; the
    optimizer keeps the EMA with μ = max(DECAYS).

    ``blt``: flat clipping with ``noise_mechanism=BltNoise(θ, ω)`` of :func:`plan_blt` and a
    ``FixedOrderBatchSampler(N, B, total_steps=T)`` whose one shuffle is seeded with
    ``seed + 1`` like the cyclic sampler (the model initialisation and the noise seed are
    shared with the other methods of the seed; the batches cannot be: fixed order is not
    Poisson sampling). The accountant records rate 1 (no amplification).

    ``user_ids`` (user-level tasks: the user of each training row): the unit is a user;
    ``PoissonUserBatchSampler(user_ids, q, bands=b)`` samples users (cyclic Poisson over the
    users when b > 1, plain Poisson when b = 1) and yields the rows of the sampled users;
    ``n_units`` is the number of users."""
    from adaclip.strategies import FlatClipping, PerLayerClipping, QuantileClipping, QuantileRule
    from adaclip_torch import AdaClip, DPOptimizer
    from adaclip_torch.data import CyclicPoissonBatchSampler, FixedOrderBatchSampler, PoissonUserBatchSampler

    b = plan["bands"]
    generator = torch.Generator().manual_seed(seed + 1)
    if user_ids is not None:
        if run_kind == "blt":
            raise ValueError("blt runs cover example-level tasks only (FixedOrderBatchSampler orders examples)")
        sampler = PoissonUserBatchSampler(user_ids, plan["q"], num_steps=plan["per_epoch"], generator=generator,
                                          bands=b)  # fmt: skip
    elif run_kind == "blt":
        sampler = FixedOrderBatchSampler(n_units, plan["batch_size"], generator=generator, total_steps=plan["steps"])
    else:
        sampler = CyclicPoissonBatchSampler(n_units, plan["q"], bands=b, num_steps=plan["per_epoch"],
                                            generator=generator)  # fmt: skip
    common: dict[str, Any] = {
        "noise_multiplier": plan["sigma"], "expected_batch_size": plan["q"] * n_units,
        "accountant": accounting.Accountant(plan["accountant"], target_epsilon=epsilon, delta=DELTA), "sample_rate": plan["q"],
        "seed": seed, "averaging": AveragingConfig(kind="ema", decay=max(DECAYS)),
    }  # fmt: skip
    if run_kind == "blt":
        common.update(noise_mechanism=BltNoise(plan["theta"], plan["omega"]), sampler=sampler,
                      expected_batch_size=sampler.expected_batch_size, sample_rate=sampler.sample_rate)  # fmt: skip
    elif b > 1:
        common.update(noise_mechanism=BandedNoise(plan["coefficients"]), sampler=sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseDominatedWarning)
        if run_kind.startswith("adaclip"):
            opt = AdaClip(inner, model, max_grad_norm=clip, **common)
        else:
            strategy = (
                QuantileClipping(clip, QuantileRule()) if run_kind in ("quantile", "quantile-banded")  # γ = 0.5
                else PerLayerClipping(max_grad_norm=clip) if run_kind == "per-layer"  # C_k = C/√K
                else FlatClipping(clip)
            )  # fmt: skip
            opt = DPOptimizer(inner, model, strategy=strategy, use_kernel=False, **common)
    return opt, sampler


def train(
    task: Task,
    run_kind: str,
    hp: dict[str, float],
    plan: dict[str, Any],
    *,
    optimizer: str,
    epsilon: float,
    seed: int,
    train_idx: np.ndarray,
    eval_idx: np.ndarray | None,
    epochs: int,
    also_test: bool = False,
) -> dict[str, Any]:
    """One private run; scores the live parameters (``metric``) and every EMA of :data:`DECAYS`
    (``ema<μ>``) on the validation rows ``eval_idx`` or on the test split (``None``);
    ``also_test``: the same scores on the test split too (``test_metric``, ``test_ema<μ>``), for
    a run picked on validation and reported on test without training it again."""
    from adaclip_torch import ParameterAverage

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = task.make_model(seed)
    inner = make_optimizer(optimizer, trainable(model), hp["lr"] * plan.get("lr_scale", 1.0))
    x_tr = torch.as_tensor(task.x_train[train_idx])
    y_tr = torch.as_tensor(task.y_train[train_idx])
    users = torch.as_tensor(task.user_train[train_idx]) if task.user_level else None
    opt, sampler = build_private(run_kind, model, inner, hp["max_grad_norm"], plan, epsilon=epsilon, seed=seed,
                                 n_units=units_of(task, train_idx), user_ids=users)  # fmt: skip
    others = {mu: ParameterAverage(model, decay=mu) for mu in DECAYS if mu != max(DECAYS)}
    for avg in others.values():
        avg.attach(opt)
    examples = 0  # units stepped on, summed over the run (fixed order: epochs·N)
    for _ in range(epochs):  # one pass of the sampler per epoch (fixed order: b = ⌈N/B⌉ batches, none empty)
        for idx in sampler:
            examples += len(idx)
            if len(idx) == 0:
                opt.step(empty_batch=True)
            else:
                task_loss(task, model, x_tr[idx], y_tr[idx]).backward()
                opt.step() if users is None else opt.step(user_ids=users[idx])  # user level: one unit per user
            opt.zero_grad()
    splits = [("", (task.x_test, task.y_test) if eval_idx is None else (task.x_train[eval_idx], task.y_train[eval_idx]))]
    if also_test:
        splits.append(("test_", (task.x_test, task.y_test)))
    out: dict[str, Any] = {}
    for prefix, (ex, ey) in splits:
        out[f"{prefix}metric"] = evaluate(task, model, ex, ey)["metric"]
        with opt.averaged():
            out[f"{prefix}ema{max(DECAYS)}"] = evaluate(task, model, ex, ey)["metric"]
        for mu, avg in others.items():
            with avg.averaged():
                out[f"{prefix}ema{mu}"] = evaluate(task, model, ex, ey)["metric"]
    out.update(epsilon=opt.accountant.epsilon(DELTA), sigma=plan["sigma"], bands=plan["bands"], steps=opt.steps,
               examples=examples, seconds=time.perf_counter() - t0)  # fmt: skip
    opt.remove_hooks()
    return out


# --------------------------------------------------------------------------- protocol


def load_any(name: str) -> Task:
    """A task of round one, two or three by name."""
    return load_round3_task(name) if name in ROUND3_TASKS else load(name)


def units_of(task: Task, rows: np.ndarray) -> int:
    """The number of privacy units among training ``rows``: users (user level) or rows."""
    return int(len(np.unique(task.user_train[rows]))) if task.user_level else len(rows)



def score(run: dict[str, Any], method: str, mu: float | None) -> float:
    return run[f"ema{mu}"] if uses_ema(method) and mu is not None else run["metric"]


def run_cell(task: Task, args: argparse.Namespace, epsilon: float, log: Any = print) -> dict[str, Any]:
    """Tuning and final runs of every method of one (task, optimizer, ε)."""
    train_sub, val = split_validation(task)
    full = np.arange(len(task.y_train))
    epochs = args.epochs or task.epochs
    kw = {"optimizer": args.optimizer, "epsilon": epsilon, "epochs": epochs}
    configs = args.configs
    train_fn = train
    if getattr(args, "framework", "torch") == "jax":
        from round3_jax import train_jax as train_fn
    reused = reused_methods(args.reuse, task, args, epsilon) if getattr(args, "reuse", None) else {}
    to_run = [m for m in args.methods if m not in reused.get("final", {})]
    run_kinds = sorted({RUN_OF[m] for m in to_run}, key=list(RUN_OF.values()).index)

    def bands_of(kind: str) -> list[int | None]:
        return (
            [1] if kind in ("flat", "adaclip", "quantile", "per-layer") else list(args.bands_grid) if kind == "banded-grid" else [None]
        )

    def plans(n_units: int) -> dict[tuple[str, int | None], dict[str, Any]]:
        return {(k, b): plan_noise(task, n_units, epochs, epsilon, args.optimizer, b, run_kind=k)
                for k in run_kinds for b in bands_of(k)}  # fmt: skip

    tune_plans, final_plans = plans(units_of(task, train_sub)), plans(units_of(task, full))
    cell: dict[str, Any] = {"epsilon": epsilon, "plans": {f"{k}|{b}": p for (k, b), p in final_plans.items()},
                            "tuning": {}, "winners": {}, "final": {}}  # fmt: skip
    t_cell = time.perf_counter()
    # 1. tuning: every training run of the grid once per tuning seed (shared by X and X+ema)
    tuned: dict[str, list[dict[str, Any]]] = {}
    for kind in run_kinds:
        rows = []
        for b in bands_of(kind):
            for hp in configs:
                runs = [train_fn(task, kind, hp, tune_plans[(kind, b)], seed=1000 + s, train_idx=train_sub,
                                 eval_idx=val, **kw) for s in range(args.tune_seeds)]  # fmt: skip
                rows.append({"hp": hp, "bands_arg": b, "runs": runs})
                log(f"  tune {kind} b={runs[0]['bands']} {hp}: val {runs[0]['metric']:.3f} "
                    f"ema {[round(runs[0][f'ema{m}'], 3) for m in DECAYS]} ({runs[0]['seconds']:.0f}s)")  # fmt: skip
        tuned[kind] = rows
    cell["tuning"] = tuned
    # 2. winners per method (ties: the first in grid order, then the smallest μ)
    for method in to_run:
        cell["winners"][method] = pick_winner(tuned[RUN_OF[method]], method)
    # 3. final runs: one training run per (run kind, b, hp) and seed, scored for every method using it
    done: dict[tuple, list[dict[str, Any]]] = {}
    for method in to_run:
        w = cell["winners"][method]
        kind = RUN_OF[method]
        ident = (kind, w["bands_arg"], tuple(sorted(w["hp"].items())))
        if ident not in done:
            done[ident] = []
            for seed in range(args.seeds):
                r = train_fn(task, kind, w["hp"], final_plans[(kind, w["bands_arg"])], seed=seed, train_idx=full,
                             eval_idx=None, **kw)  # fmt: skip
                r["seed"] = seed
                done[ident].append(r)
                log(f"  final {kind} b={r['bands']} {w['hp']} seed {seed}: test {r['metric']:.3f} "
                    f"ema {[round(r[f'ema{m}'], 3) for m in DECAYS]} ({r['seconds']:.0f}s)")  # fmt: skip
        runs = done[ident]
        metrics = [score(r, method, w["mu"]) for r in runs]
        cell["final"][method] = {
            "hp": w["hp"], "mu": w["mu"], "bands": runs[0]["bands"], "sigma": runs[0]["sigma"],
            "steps": runs[0]["steps"], "runs": [{"seed": r["seed"], "metric": m} for r, m in zip(runs, metrics)],
            "test": summarise(metrics), "epsilon_spent": max(r["epsilon"] for r in runs),
            "seconds_per_run": float(np.mean([r["seconds"] for r in runs])), "raw": runs,
        }  # fmt: skip
    cell["wall_seconds"] = time.perf_counter() - t_cell
    if reused:  # earlier runs of the same cell (same grid, seeds, epochs; deterministic per seed): copied
        for part in ("plans", "tuning", "winners", "final"):
            cell[part] = {**reused[part], **cell[part]}
        cell["reused"] = {"file": reused["file"], "methods": sorted(reused["final"])}
    return cell


def reused_methods(paths: Path | list[Path], task: Task, args: argparse.Namespace, epsilon: float) -> dict[str, Any]:
    """The methods of ``args.methods`` that earlier result files of the same cell already have,
    with their plans, tuning rows, winners and final runs, to be copied instead of re-run.

    Every run is deterministic given its seed (model initialisation, sampler and noise are
    seeded), so a copied run is the run this command would make; each file must agree on the
    task, framework, optimizer, grid, seeds, tuning seeds and epochs, or it is refused. With
    several files, a method is taken from the last file that has it."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    wanted = {"task": task.name, "framework": getattr(args, "framework", "torch"), "optimizer_name": args.optimizer,
              "grid": args.configs, "seeds": list(range(args.seeds)), "tune_seeds": list(range(args.tune_seeds)),
              "epochs": args.epochs or task.epochs}  # fmt: skip
    merged: dict[str, Any] = {"plans": {}, "tuning": {}, "winners": {}, "final": {}}
    for path in paths:
        earlier = json.loads(Path(path).read_text())
        for key, value in wanted.items():
            if earlier.get(key) != value:
                raise ValueError(f"--reuse {path}: its {key} is {earlier.get(key)!r}, this run's is {value!r}")
        cell = earlier["cells"].get(str(epsilon))
        if cell is None:
            raise ValueError(f"--reuse {path} has no cell at epsilon = {epsilon:g}")
        methods = [m for m in args.methods if m in cell["final"]]
        kinds = {RUN_OF[m] for m in methods}
        merged["plans"].update({k: v for k, v in cell["plans"].items() if k.split("|")[0] in kinds})
        merged["tuning"].update({k: v for k, v in cell["tuning"].items() if k in kinds})
        merged["winners"].update({m: cell["winners"][m] for m in methods})
        merged["final"].update({m: cell["final"][m] for m in methods})
    merged["file"] = ", ".join(Path(path).name for path in paths)
    return merged


#: The accounting method of the calibration and the accountant (``--accountant``).
ACCOUNTANT = "rdp"


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=TASKS + ROUND2_TASKS + ROUND3_TASKS)
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd")
    p.add_argument("--epsilons", type=float, nargs="+", default=[3.0])
    p.add_argument("--seeds", type=int, default=3, help="final-run seeds 0..S-1")
    p.add_argument("--tune-seeds", type=int, default=1)
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    p.add_argument("--bands-grid", type=int, nargs="+", default=[4, 16], help="b values of banded-grid")
    p.add_argument("--epochs", type=int, default=None, help="override the task's epochs (tests, smoke runs)")
    p.add_argument(
        "--lrs", type=float, nargs="+", default=None, help="override the grid's learning rates (tests)"
    )
    p.add_argument(
        "--clips", type=float, nargs="+", default=None, help="override the grid's clip norms (tests)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--framework", choices=("torch", "jax"), default="torch",
        help="train with adaclip_torch (default) or adaclip_jax (MLP tasks; round3_jax.py)",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="suffix of the output file name")
    p.add_argument(
        "--reuse", type=Path, nargs="+", default=None,
        help="earlier result JSONs of the same cell: their methods among --methods are copied, not re-run "
        "(a method from the last file that has it)",
    )
    p.add_argument(
        "--accountant", choices=("rdp", "pld"), default="rdp",
        help="calibrate σ and account with this method (rdp: every record before 2026-11-28; pld: the "
        "library's default since then, scripts/main.sh)",
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--report", type=Path, nargs="+", default=None, help="print the tables of these JSONs")
    args = p.parse_args(argv)
    global ACCOUNTANT
    ACCOUNTANT = args.accountant
    if args.report:  # the report's own command: report_round3.py FILES
        import report_round3

        report_round3.main([str(f) for f in args.report])
        return None
    if args.task is None:
        p.error("--task is required (or --report)")
    torch.set_num_threads(args.threads)
    logging.getLogger("absl").setLevel(logging.ERROR)
    task = load_any(args.task)
    if args.framework == "jax" and any(RUN_OF[m] == "blt" for m in args.methods):
        p.error("blt and blt+ema train with adaclip_torch only (--framework torch)")
    if task.user_level and any(RUN_OF[m] == "blt" for m in args.methods):
        p.error("blt and blt+ema cover example-level tasks only (fixed-order batches of examples)")
    if task.user_level and args.framework == "jax":
        p.error("--framework jax covers example-level tasks only")
    args.configs = grid(BASE.get(task.name, task.name), args.optimizer)  # round two's lr × C grid: the same budget per method
    if args.lrs or args.clips:
        lrs = args.lrs or sorted({c["lr"] for c in args.configs})
        clips = args.clips or sorted({c["max_grad_norm"] for c in args.configs})
        args.configs = [{"lr": lr, "max_grad_norm": c} for lr in lrs for c in clips]
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    last = None
    for eps in args.epsilons:
        out: dict[str, Any] = {
            "task": task.name, "framework": args.framework, "optimizer": OPTIMIZERS[args.optimizer],
            "optimizer_name": args.optimizer, "delta": DELTA, "epsilons": [eps], "seeds": list(range(args.seeds)),
            "tune_seeds": list(range(args.tune_seeds)), "epochs": args.epochs or task.epochs,
            "accountant": ACCOUNTANT,
            "expected_batch_size": task.batch_size, "grid": args.configs, "decays": list(DECAYS),
            "methods": list(args.methods), "bands_grid": list(args.bands_grid),
            "command": "python benchmarks/utility/round3.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "versions": versions(), "machine": machine(), "threads": args.threads,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cells": {},
        }  # fmt: skip
        log(f"{task.name}, {args.optimizer}, ε = {eps:g}")
        out["cells"][str(eps)] = run_cell(task, args, eps, log)
        path = args.out / f"round3_{task.name}_{args.framework}_{args.optimizer}_eps{eps:g}{args.tag}.json"
        path.write_text(json.dumps(out, indent=1, default=str))
        log(report([out]))
        log(f"wrote {path} ({out['cells'][str(eps)]['wall_seconds']:.0f}s)")
        last = out
    return last


if __name__ == "__main__":
    main()
