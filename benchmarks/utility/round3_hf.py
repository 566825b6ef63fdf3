"""Utility, round three, on the Hugging Face fine-tuning task: banded noise and averaging against
DP-SGD when fully fine-tuning the GPT-2-style model of ``examples/hf_finetune.py``.

The task is the example's (its functions are imported, not copied): a ``GPT2LMHeadModel``
(random init, character tokenizer) pretrained without privacy on standard-library docstrings,
then fully fine-tuned with AdamW through :func:`adaclip_torch.make_private` on NumPy docstrings.
A privacy unit is one record (a window of at most 64 characters of one docstring); the metric is
the next-token accuracy on the held-out private docstrings (the loss is recorded too).

Methods (all with flat clipping at ``C``; :data:`METHODS`):

- ``flat``: DP-SGD, ``make_private(noise_mechanism="independent")``, σ calibrated by
  make_private for ``T = epochs·round(1/q)`` compositions at ``q = B̄/N``.
- ``flat+ema``: the same runs, scored on an EMA of the parameters, μ ∈ {0.9, 0.99, 0.999} picked
  on validation with lr and C. μ = 0.999 is make_private's own ``averaging=AveragingConfig(
  kind="ema", decay=0.999)``; 0.9 and 0.99 are ``ParameterAverage(model, decay=μ)`` attached to
  the same optimizer (post-processing of the same releases, as in ``round3.py``).
- ``banded``: ``make_private(noise_mechanism="banded", bands=None)``: the library chooses b
  (for AdamW at most 4), samples with cyclic Poisson sampling and calibrates σ_b for ⌈T/b⌉
  compositions at rate b·q. If the rule picks b = 1 that is DP-SGD itself (the JSON says so).
- ``banded+ema``: the banded runs on their EMA (μ picked on validation).
- ``recommended``: the banded runs with the averaging picked on validation among no averaging
  and the three μ: what the docs recommend.

Protocol (round three's): the private training records are split into a tuning set and a
validation set (every 5th private training docstring, about 20 % of the records, goes to
validation: whole documents, so no validation text was trained on); every method trains on the
tuning set once (tuning seed 1000) for each point of the same grid, ``--lrs`` × ``--clips``
(default lr ∈ {1e-3, 3e-3} × C ∈ {0.1, 1}); the best validation accuracy wins (ties: grid order,
then the smallest μ); the winners are retrained on all the private training records with seeds
0..S−1 and scored once on the held-out private split. Within a seed every method starts from the
same pretrained model and shares the noise seed and the dropout seed, so Δ vs ``flat`` is paired.
The public model is pretrained once per process (or loaded from ``--base``), never per run.

    python benchmarks/utility/round3_hf.py --threads 1 --seeds 3               # the example's FULL setting
    python benchmarks/utility/round3_hf.py --threads 1 --seeds 3 --epochs 3     # 3 passes (192 steps)
    python benchmarks/utility/round3_hf.py --quick --seeds 1 --lrs 3e-3 --clips 1 --out /tmp/x   # seconds
    python benchmarks/utility/round3_hf.py --report benchmarks/results/round3_hf_finetune_torch_adamw_eps8.json

Output: ``benchmarks/results/round3_hf_finetune_torch_adamw_eps<ε><tag>.json`` (``cells`` shaped
as ``round3.py``'s, so ``report_round3.py`` can read it) and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "examples"))

import hf_finetune as hf  # noqa: E402  (examples/hf_finetune.py)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from methods_round3 import DECAYS, pick_winner  # noqa: E402
from report_round3 import paired, verdict  # noqa: E402
from run import machine, summarise, versions  # noqa: E402

from adaclip.averaging import AveragingConfig  # noqa: E402
from adaclip.errors import NoiseDominatedWarning  # noqa: E402

RESULTS = HERE.parent / "results"
TASK = "hf_finetune"
METHODS = ("flat", "flat+ema", "banded", "banded+ema", "recommended", "banded-lr", "recommended-lr")
DEFAULT_METHODS = METHODS[:5]  # the methods of the first recorded runs; the -lr pair is asked for by name
#: the training run each method reads (``X+ema`` and ``recommended`` are post-processing of it)
RUN_OF = {"flat": "flat", "flat+ema": "flat", "banded": "banded", "banded+ema": "banded", "recommended": "banded",
          "banded-lr": "banded-lr", "recommended-lr": "banded-lr"}  # fmt: skip
NOISE_MECHANISM = {"flat": "independent", "banded": "banded", "banded-lr": "banded"}
#: make_private's ``scale_adaptive_lr`` per run kind: ``banded`` keeps AdamW's learning rate (the
#: runs recorded before the option existed), ``banded-lr`` multiplies it by ρ (the library's default)
SCALE_ADAPTIVE_LR = {"flat": False, "banded": False, "banded-lr": True}
VALIDATION_EVERY = 5  # every 5th private training docstring is a validation document (about 20 %)
TUNE_SEED = 1000


# --------------------------------------------------------------------------- data


def records_per_document(docs: list[str], tokenizer: hf.Tokenizer, length: int) -> list[int]:
    """How many records :func:`hf_finetune.windows` cuts each document into (its rule: one per
    ``length`` tokens, the last one kept if it has at least 2 tokens)."""
    counts = []
    for doc in docs:
        n = len(tokenizer.encode(doc))
        counts.append(sum(1 for i in range(0, n, length) if n - i >= 2))
    return counts


def validation_mask(counts: list[int], num_records: int, every: int = VALIDATION_EVERY) -> torch.Tensor:
    """A boolean mask over the first ``num_records`` records: True for the records of every
    ``every``-th document (documents, not records, are held out, as the example's test split)."""
    doc_of_record = np.repeat(np.arange(len(counts)), counts)[:num_records]
    if len(doc_of_record) != num_records:
        raise ValueError(f"{num_records} records asked for, the documents make {len(doc_of_record)}")
    return torch.as_tensor(doc_of_record % every == 0)


@dataclasses.dataclass
class Data:
    train: torch.utils.data.TensorDataset  # every private training record (final runs)
    tune: torch.utils.data.TensorDataset  # the training records minus validation (tuning runs)
    validation: tuple[torch.Tensor, torch.Tensor]
    test: tuple[torch.Tensor, torch.Tensor]  # held-out private docstrings (final scores only)
    public: tuple[torch.Tensor, torch.Tensor]  # public training records (pretraining)
    counts: dict[str, int]


def load_data(setting: hf.Setting, tokenizer: hf.Tokenizer) -> Data:
    """The example's corpora and splits (the first ``setting.private_records`` private training
    records, ``setting.eval_records`` held-out ones), plus the validation split carved out of
    the private training records by document."""
    length = setting.length
    public_train, _ = hf.split(hf.docstrings(hf.PUBLIC_MODULES))
    private_train, private_test = hf.split(hf.docstrings(hf.PRIVATE_MODULES))
    ids, mask = hf.windows(private_train, tokenizer, length)
    if setting.private_records:
        ids, mask = ids[: setting.private_records], mask[: setting.private_records]
    val = validation_mask(records_per_document(private_train, tokenizer, length), len(ids))
    test_ids, test_mask = hf.windows(private_test, tokenizer, length)
    return Data(
        train=torch.utils.data.TensorDataset(ids, mask),
        tune=torch.utils.data.TensorDataset(ids[~val], mask[~val]),
        validation=(ids[val], mask[val]),
        test=(test_ids[: setting.eval_records], test_mask[: setting.eval_records]),
        public=hf.windows(public_train, tokenizer, length),
        counts={"train": len(ids), "tune": int((~val).sum()), "validation": int(val.sum()),
                "test": min(len(test_ids), setting.eval_records)},
    )  # fmt: skip


def pretrained_base(setting: hf.Setting, data: Data, *, base: Path | None, seed: int, log: Any) -> torch.nn.Module:
    """The example's public pretraining, once: loaded from ``base`` if it holds a saved model,
    else pretrained (and saved there when ``base`` is given)."""
    if base is not None and (base / "config.json").is_file():
        log(f"loading the pretrained model from {base}")
        return hf.load_model(base)
    t0 = time.perf_counter()
    model = hf.build_model(setting, hf.CharTokenizer.vocab_size, seed)
    hf.pretrain(model, *data.public, setting.pretrain_steps, setting.pretrain_batch, seed)
    log(f"pretrained {setting.pretrain_steps} steps in {time.perf_counter() - t0:.0f}s")
    if base is not None:
        model.save_pretrained(str(base))
    return model


# --------------------------------------------------------------------------- one run


def train(
    base: torch.nn.Module,
    dataset: torch.utils.data.TensorDataset,
    evaluation: tuple[torch.Tensor, torch.Tensor],
    *,
    kind: str,
    lr: float,
    clip: float,
    seed: int,
    epsilon: float,
    delta: float,
    setting: hf.Setting,
) -> dict[str, Any]:
    """One private full fine-tuning run (``kind`` ``"flat"`` or ``"banded"``) through the
    example's ``private_finetune`` with σ (and b) chosen by make_private for the target; scores
    the live parameters and the EMA of every μ of :data:`DECAYS` on ``evaluation``."""
    from adaclip_torch import ParameterAverage

    t0 = time.perf_counter()
    args = argparse.Namespace(lr=lr, lora_lr=lr, max_grad_norm=clip, seed=seed, epsilon=epsilon, delta=delta,
                              per_sample_mode="auto")  # fmt: skip
    others: dict[float, Any] = {}

    def attach(model: torch.nn.Module, optimizer: Any) -> None:
        for mu in DECAYS:
            if mu != max(DECAYS):
                others[mu] = ParameterAverage(model, decay=mu)
                others[mu].attach(optimizer)

    torch.manual_seed(seed)  # dropout: shared by the methods of a seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoiseDominatedWarning)
        run = hf.private_finetune(base, dataset, use_lora=False, strategy="flat", sigma=None, args=args,
                                  setting=setting, noise_mechanism=NOISE_MECHANISM[kind],
                                  scale_adaptive_lr=SCALE_ADAPTIVE_LR[kind],
                                  averaging=AveragingConfig(kind="ema", decay=max(DECAYS)), prepare=attach)  # fmt: skip
    opt = run.optimizer
    scores: dict[str, Any] = {"live": hf.evaluate(run.model, *evaluation)}
    with opt.averaged():
        scores[f"ema{max(DECAYS)}"] = hf.evaluate(run.model, *evaluation)
    for mu, avg in others.items():
        with avg.averaged():
            scores[f"ema{mu}"] = hf.evaluate(run.model, *evaluation)
    coefficients = opt.noise_coefficients
    out: dict[str, Any] = {
        "kind": kind, "lr": lr, "lr_scale": opt.lr_scale, "max_grad_norm": clip, "seed": seed,
        "noise_mechanism": opt.noise_mechanism,
        "bands": 1 if coefficients is None else len(coefficients), "sigma": opt.noise_multiplier,
        "epsilon": run.epsilon, "steps": run.steps, "records": len(dataset),
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    for key, q in scores.items():  # "metric" is the accuracy (round3.py's name), "loss" in nats per token
        prefix = "" if key == "live" else f"{key}_"
        out[f"{prefix}metric" if key == "live" else key] = q.accuracy
        out[f"{prefix}loss"] = q.loss
    return out


def score(run: dict[str, Any], mu: float | None, what: str = "metric") -> float:
    """The run's accuracy (``what="metric"``) or loss (``"loss"``), live or on the EMA ``μ``."""
    if mu is None:
        return run[what]
    return run[f"ema{mu}"] if what == "metric" else run[f"ema{mu}_loss"]


# --------------------------------------------------------------------------- protocol


def run_cell(base: torch.nn.Module, data: Data, args: argparse.Namespace, setting: hf.Setting,
             log: Any = print) -> dict[str, Any]:  # fmt: skip
    """Tuning runs, winners and final runs of every method at ``args.epsilon``."""
    grid = [{"lr": lr, "max_grad_norm": c} for lr in args.lrs for c in args.clips]  # the same for every method
    kinds = sorted({RUN_OF[m] for m in args.methods}, key=["flat", "banded", "banded-lr"].index)
    kw = {"epsilon": args.epsilon, "delta": args.delta, "setting": setting}
    cell: dict[str, Any] = {"epsilon": args.epsilon, "grid": grid, "tuning": {}, "winners": {}, "final": {}}
    t_cell = time.perf_counter()
    for kind in kinds:  # 1. tuning: one run per grid point (shared by X, X+ema and recommended)
        rows = []
        for hp in grid:
            r = train(base, data.tune, data.validation, kind=kind, lr=hp["lr"], clip=hp["max_grad_norm"],
                      seed=TUNE_SEED, **kw)  # fmt: skip
            rows.append({"hp": hp, "runs": [r]})
            log(f"  tune {kind} b={r['bands']} σ={r['sigma']:.3f} {hp}: val acc {r['metric']:.4f} loss "
                f"{r['loss']:.4f}, ema {[round(r[f'ema{m}'], 4) for m in DECAYS]} ({r['seconds']:.0f}s)")  # fmt: skip
        cell["tuning"][kind] = rows
    for method in args.methods:  # 2. winners on validation
        cell["winners"][method] = pick_winner(cell["tuning"][RUN_OF[method]], method)
    done: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for method in args.methods:  # 3. final runs: one per (kind, hp) and seed, read by every method using it
        w = cell["winners"][method]
        kind = RUN_OF[method]
        ident = (kind, w["hp"]["lr"], w["hp"]["max_grad_norm"])
        if ident not in done:
            done[ident] = []
            for seed in range(args.seeds):
                r = train(base, data.train, data.test, kind=kind, lr=w["hp"]["lr"], clip=w["hp"]["max_grad_norm"],
                          seed=seed, **kw)  # fmt: skip
                done[ident].append(r)
                log(f"  final {kind} b={r['bands']} {w['hp']} seed {seed}: test acc {r['metric']:.4f} loss "
                    f"{r['loss']:.4f}, ema {[round(r[f'ema{m}'], 4) for m in DECAYS]} ({r['seconds']:.0f}s)")  # fmt: skip
        runs = done[ident]
        acc = [score(r, w["mu"]) for r in runs]
        loss = [score(r, w["mu"], "loss") for r in runs]
        cell["final"][method] = {
            "hp": w["hp"], "mu": w["mu"], "bands": runs[0]["bands"], "sigma": runs[0]["sigma"],
            "noise_mechanism": runs[0]["noise_mechanism"], "steps": runs[0]["steps"],
            "runs": [{"seed": r["seed"], "metric": a, "loss": lo} for r, a, lo in zip(runs, acc, loss)],
            "test": summarise(acc), "test_loss": summarise(loss), "epsilon_spent": max(r["epsilon"] for r in runs),
            "seconds_per_run": float(np.mean([r["seconds"] for r in runs])), "raw": runs,
        }  # fmt: skip
    cell["wall_seconds"] = time.perf_counter() - t_cell
    return cell


def table(out: dict[str, Any]) -> str:
    """The cell's Markdown table: accuracy in %, loss in nats per character, Δ paired by seed
    against ``flat`` (accuracy in points, round two's reading; loss: lower is better)."""
    cell = next(iter(out["cells"].values()))
    final = cell["final"]
    base = final.get("flat")
    lines = [
        "| method | lr | C | μ | b | σ | test acc. % (± SE) | Δ acc. vs flat (± SE) | reading | test loss (± SE) "
        "| Δ loss vs flat (± SE) | ε spent | s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, f in final.items():
        acc = 100.0 * np.array([r["metric"] for r in f["runs"]])
        loss = np.array([r["loss"] for r in f["runs"]])

        def se(a: np.ndarray) -> float:
            return float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else math.nan

        if base is None or method == "flat":
            d_acc, read, d_loss = "—", "baseline" if method == "flat" else "—", "—"
        else:
            d, dse = paired(f, base)
            lo = {r["seed"]: r["loss"] for r in f["runs"]}
            dl = np.array([lo[r["seed"]] - r["loss"] for r in base["runs"] if r["seed"] in lo])
            d_acc, read = f"{d:+.2f} ± {dse:.2f}", verdict(d, dse)
            d_loss = f"{dl.mean():+.4f} ± {se(dl):.4f}"
        lines.append(
            f"| {method} | {f['hp']['lr']:g} | {f['hp']['max_grad_norm']:g} | {'—' if f['mu'] is None else f['mu']} | "
            f"{f['bands']} | {f['sigma']:.3f} | {acc.mean():.2f} ± {se(acc):.2f} | {d_acc} | {read} | "
            f"{loss.mean():.4f} ± {se(loss):.4f} | {d_loss} | {f['epsilon_spent']:.4f} | {f['seconds_per_run']:.0f} |"
        )  # fmt: skip
    return "\n".join(lines)


def package_versions() -> dict[str, str]:
    out = versions()
    for pkg in ("transformers", "peft"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the example's --quick setting (tests)")
    p.add_argument("--epochs", type=int, default=None, help="passes over the private data (default: the setting's, 1)")
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seeds", type=int, default=3, help="final-run seeds 0..S-1")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3], help="AdamW learning rates of the grid")
    p.add_argument("--clips", type=float, nargs="+", default=[0.1, 1.0], help="clip norms C of the grid")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    p.add_argument("--base", type=Path, default=None,
                   help="a directory for the pretrained model: loaded if it holds one, else pretrained and saved there")
    p.add_argument("--pretrain-seed", type=int, default=0, help="the example's --seed for public pretraining")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="suffix of the output file name")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--report", type=Path, default=None, help="print the table of this result JSON and stop")
    args = p.parse_args(argv)
    if args.report is not None:
        res = json.loads(args.report.read_text())
        print(table(res))
        return res
    if "flat" not in args.methods:
        p.error("flat is the baseline: keep it in --methods")
    torch.set_num_threads(args.threads)
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, flush=True))
    setting = hf.QUICK if args.quick else hf.FULL
    if args.epochs is not None:
        setting = dataclasses.replace(setting, epochs=args.epochs)
    data = load_data(setting, hf.CharTokenizer())
    log(f"records: {data.counts}")
    base = pretrained_base(setting, data, base=args.base, seed=args.pretrain_seed, log=log)
    base.train()
    pretrained = {"validation": dataclasses.asdict(hf.evaluate(base, *data.validation)),
                  "test": dataclasses.asdict(hf.evaluate(base, *data.test))}  # fmt: skip
    out: dict[str, Any] = {
        "task": TASK, "framework": "torch", "optimizer": "AdamW (weight_decay=0), full fine-tuning",
        "optimizer_name": "adamw", "setting": "quick" if args.quick else "full", "sizes": dataclasses.asdict(setting),
        "delta": args.delta, "epsilons": [args.epsilon], "seeds": list(range(args.seeds)), "tune_seeds": [TUNE_SEED],
        "epochs": setting.epochs, "expected_batch_size": setting.batch_size, "decays": list(DECAYS),
        "methods": list(args.methods), "records": data.counts, "validation_every": VALIDATION_EVERY,
        "pretrained": pretrained, "metric": "next-token accuracy on held-out private docstrings",
        "command": "python benchmarks/utility/round3_hf.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": package_versions(), "machine": machine(), "threads": args.threads,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cells": {},
    }  # fmt: skip
    log(f"{TASK}, AdamW, ε = {args.epsilon:g}, {setting.epochs} epoch(s)")
    out["cells"][str(args.epsilon)] = run_cell(base, data, args, setting, log)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"round3_{TASK}_torch_adamw_eps{args.epsilon:g}{args.tag}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    log(table(out))
    log(f"wrote {path} ({out['cells'][str(args.epsilon)]['wall_seconds']:.0f}s)")
    return out


if __name__ == "__main__":
    main()
