"""Tables and plots of the round-two utility benchmark, from its result JSONs::

    python benchmarks/utility/report_round2.py benchmarks/results/round2_*.json [--plots DIR] [--write MD]

(``round2.py --report FILES`` runs the same.) The tables of the recorded runs are in
``benchmarks/results/utility_round2.md``. This module imports no framework: the method names
come from :mod:`methods_round2`.

Every difference is *paired*: within a seed, two methods share the model initialisation,
the Poisson batches and the noise seed, so Δ = mean over seeds of (a_s − b_s) and its
standard error is ``std(a − b, ddof=1)/√S``.

- **Equal budget**: each method's validation winner (the same 4-configuration grid). The
  comparison for the first target is against the best *baseline* (flat, per-layer,
  quantile) by test mean — the strictest reading, since a practitioner would have picked
  among them on validation.
- **Tuning-free**: each method at its default ``C = 1`` with the learning rate tuned, against
  flat clipping tuned over learning rate × C.
- **Recommended configuration**: the adaptive method with the best mean *validation* score
  over all cells of the tuning-free protocol (the test split plays no part in the choice).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from methods_round2 import ADAPTIVE, BASELINES, PATENT_DEFAULTS  # noqa: E402


def _metrics(final: dict[str, Any]) -> np.ndarray:
    return np.array([r["metric"] for r in sorted(final["runs"], key=lambda r: r["seed"])], dtype=np.float64)


def _by_seed(final: dict[str, Any]) -> dict[int, float]:
    return {int(r["seed"]): float(r["metric"]) for r in final["runs"]}


def paired(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float, int]:
    """(Δ = mean(a − b) in points, its standard error, seeds where a > b), over the seeds both
    were run with (a configuration re-run with more seeds is paired on the seeds they share)."""
    ra, rb = _by_seed(a), _by_seed(b)
    common = sorted(ra.keys() & rb.keys())
    if not common:
        raise ValueError("the two configurations share no seed: nothing to pair")
    d = 100.0 * (np.array([ra[s] for s in common]) - np.array([rb[s] for s in common]))
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan
    return float(d.mean()), se, int((d > 0).sum())


def _mean_se(final: dict[str, Any]) -> str:
    m = 100.0 * _metrics(final)
    se = m.std(ddof=1) / math.sqrt(len(m)) if len(m) > 1 else math.nan
    return f"{m.mean():.1f} ± {se:.1f}"


def verdict_beats(delta: float, se: float) -> str:
    """Target 1 for one cell: ahead by ≥ 2 SE ('ahead'), not behind by more than 1 SE ('≈'),
    else 'behind'."""
    if se == 0.0 or math.isnan(se):
        return "ahead" if delta > 0 else ("≈" if delta == 0 else "behind")
    if delta >= 2.0 * se:
        return "ahead"
    if delta >= -1.0 * se:
        return "≈"
    return "behind"


def _cells(results: list[dict[str, Any]]):
    for res in results:
        for eps, cell in res["cells"].items():
            yield res, float(eps), cell


def _label(res: dict[str, Any]) -> str:
    fw = "" if res["framework"] == "torch" else f" ({res['framework']})"
    return f"{res['task']}{fw} | {res['optimizer_name']}"


def equal_budget_table(results: list[dict[str, Any]]) -> str:
    methods = [m for m in BASELINES + ADAPTIVE if any(f"{m}|tuned" in c["final"] for _, _, c in _cells(results))]
    head = "| task | optimizer | ε | " + " | ".join(methods) + " |"
    lines = [head, "|" + "---|" * (len(methods) + 3)]
    for res, eps, cell in _cells(results):
        f = cell["final"]
        means = {m: _metrics(f[f"{m}|tuned"]).mean() for m in methods if f"{m}|tuned" in f}
        top = max(means.values())
        row = []
        for m in methods:
            if f"{m}|tuned" not in f:
                row.append("—")
                continue
            c = _mean_se(f[f"{m}|tuned"])
            row.append(f"**{c}**" if means[m] == top else c)
        lines.append(f"| {_label(res).replace(' | ', ' | ', 1)} | {eps:g} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def best_baseline(cell: dict[str, Any]) -> str:
    f = cell["final"]
    present = [m for m in BASELINES if f"{m}|tuned" in f]
    return max(present, key=lambda m: _metrics(f[f"{m}|tuned"]).mean())


def target1_table(results: list[dict[str, Any]], methods: tuple[str, ...] = ADAPTIVE) -> tuple[str, dict[str, list[str]]]:
    """Δ vs the best baseline per cell, and the verdicts per method."""
    head = "| task | optimizer | ε | best baseline | " + " | ".join(methods) + " |"
    lines = [head, "|" + "---|" * (len(methods) + 4)]
    verdicts: dict[str, list[str]] = {m: [] for m in methods}
    for res, eps, cell in _cells(results):
        f = cell["final"]
        base = best_baseline(cell)
        row = []
        for m in methods:
            if f"{m}|tuned" not in f:
                row.append("—")
                continue
            d, se, wins = paired(f[f"{m}|tuned"], f[f"{base}|tuned"])
            v = verdict_beats(d, se)
            verdicts[m].append(v)
            txt = f"{d:+.1f} ± {se:.1f} ({v})"
            row.append(f"**{txt}**" if v != "≈" else txt)
        lines.append(f"| {_label(res)} | {eps:g} | {base} {_mean_se(f[f'{base}|tuned'])} | " + " | ".join(row) + " |")
    return "\n".join(lines), verdicts


def tuning_free_table(results: list[dict[str, Any]]) -> tuple[str, dict[str, list[str]]]:
    """Each method's default (C = 1, lr tuned) vs flat clipping tuned over lr × C."""
    methods = [m for m in BASELINES + ADAPTIVE + (PATENT_DEFAULTS,)
               if any(f"{m}|free" in c["final"] for _, _, c in _cells(results))]  # fmt: skip
    head = "| task | optimizer | ε | tuned flat | " + " | ".join(methods) + " |"
    lines = [head, "|" + "---|" * (len(methods) + 4)]
    verdicts: dict[str, list[str]] = {m: [] for m in methods}
    for res, eps, cell in _cells(results):
        f = cell["final"]
        if "flat|tuned" not in f or not any(k.endswith("|free") for k in f):
            continue
        row = []
        for m in methods:
            if f"{m}|free" not in f:
                row.append("—")
                continue
            d, se, _ = paired(f[f"{m}|free"], f["flat|tuned"])
            ok = d >= -se if not math.isnan(se) else d >= 0
            verdicts[m].append("met" if ok else "missed")
            txt = f"{d:+.1f} ± {se:.1f}"
            row.append(txt if ok else f"*{txt}*")
        lines.append(f"| {_label(res)} | {eps:g} | {_mean_se(f['flat|tuned'])} | " + " | ".join(row) + " |")
    return "\n".join(lines), verdicts


def recommended(results: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, float]]:
    """The configurations without tuning with the best mean *validation* score over the cells
    (validation only): overall (``make_private``'s default strategy), among the adaptive
    methods, and within the AdaCliP family (``AdaClip()``'s default)."""
    scores: dict[str, list[float]] = {}
    for _, _, cell in _cells(results):
        for m, row in cell.get("tuning_free", {}).items():
            scores.setdefault(m, []).append(row["val_mean"])
    means = {m: float(np.mean(v)) for m, v in scores.items() if len(v) == max(len(x) for x in scores.values())}
    family = [m for m in means if m.startswith("ada-")]
    best = {
        "overall": max(means, key=lambda m: means[m]),
        "adaptive": max((m for m in means if m in ADAPTIVE), key=lambda m: means[m]),
        "AdaCliP family": max(family, key=lambda m: means[m]),
    }
    return best, means


def summary(verdicts: dict[str, list[str]]) -> str:
    out = []
    for m, vs in verdicts.items():
        if vs:
            counts = {k: vs.count(k) for k in dict.fromkeys(vs)}
            out.append(f"{m}: " + ", ".join(f"{k} {n}" for k, n in counts.items()) + f" (of {len(vs)})")
    return "; ".join(out)


def plot(results: list[dict[str, Any]], folder: Path) -> list[Path]:
    """Accuracy vs ε per method (tasks run at several ε), and the learned scale's spread
    (q90/q10 of b) over training for the adaptive methods."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for res in results:
        stem = f"round2_{res['task']}_{res['framework']}_{res['optimizer_name']}"
        eps = sorted(float(e) for e in res["cells"])
        if len(eps) > 1:
            fig, ax = plt.subplots(figsize=(5, 3.5))
            for m in BASELINES + ADAPTIVE:
                ys = [res["cells"][str(e)]["final"].get(f"{m}|tuned") for e in eps]
                if all(y is not None for y in ys):
                    mean = [100 * _metrics(y).mean() for y in ys]
                    se = [100 * _metrics(y).std(ddof=1) / math.sqrt(len(y["runs"])) for y in ys]
                    ax.errorbar(eps, mean, yerr=se, marker="o", capsize=2, label=m)
            ax.set_xscale("log")
            ax.set_xlabel("ε (δ = 1e-5)")
            ax.set_ylabel(f"test {res['metric']} (%)")
            ax.set_title(f"{res['task']}, {res['optimizer_name']}, equal budget")
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = folder / f"{stem}_vs_epsilon.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        drawn = False
        for e in eps:
            for m in ("ada-patent", "ada-tensor", PATENT_DEFAULTS):
                key = f"{m}|tuned" if m != PATENT_DEFAULTS else f"{m}|free"
                f = res["cells"][str(e)]["final"].get(key)
                if f and f["runs"][0].get("spread"):
                    ax.plot(range(1, len(f["runs"][0]["spread"]) + 1), f["runs"][0]["spread"], label=f"{m}, ε={e:g}")
                    drawn = True
        if drawn:
            ax.set_yscale("log")
            ax.set_xlabel("epoch")
            ax.set_ylabel("spread of b (q90/q10), seed 0")
            ax.set_title(f"{res['task']}, {res['optimizer_name']}: learned scale")
            ax.legend(fontsize=7)
            fig.tight_layout()
            path = folder / f"{stem}_scale_spread.png"
            fig.savefig(path, dpi=110)
            written.append(path)
        plt.close(fig)
    return written


def settings_table(results: list[dict[str, Any]]) -> str:
    from adaclip.strategies import noise_drift_number

    lines = ["| task | framework | optimizer | d | units N | B̄ | steps | ε | σ | κ | wall (s) |", "|" + "---|" * 11]
    for res in results:
        for eps, cell in res["cells"].items():
            f = cell["final"]["flat|tuned"]
            kappa = noise_drift_number(res["num_params"], f["sigma"], res["expected_batch_size"])
            lines.append(f"| {res['task']} | {res['framework']} | {res['optimizer_name']} | {res['num_params']:,} | "
                         f"{res['units_train']:,} | {res['expected_batch_size']:g} | {f['steps']} | {float(eps):g} | "
                         f"{f['sigma']:.3f} | {kappa:.2f} | {cell.get('wall_seconds', res['wall_seconds']):.0f} |")  # fmt: skip
    return "\n".join(lines)


_SETTINGS = ("delta", "seeds", "tune_seeds", "epochs", "expected_batch_size", "num_params", "units_train", "grid")


def _is_reseeding(res: dict[str, Any]) -> bool:
    """A run that tuned nothing itself: it re-ran the winners of an earlier run
    (``--winners-from``), e.g. with more seeds."""
    return all(not cell.get("tuning") for cell in res["cells"].values())


def _reseed(into: dict[str, Any], res: dict[str, Any], key: tuple[str, str, str]) -> None:
    """Replace the tuned final runs of ``into`` by those of ``res``, the same winners re-run with
    more seeds. The winners must be the same, and the seeds both have must score the same
    (the re-run repeats the earlier runs before adding to them); the tuning-free runs stay."""
    differ = [k for k in _SETTINGS if k not in ("seeds", "tune_seeds") and into.get(k) != res.get(k)]
    if differ:
        raise ValueError(f"{key}: a re-run with other settings cannot extend a run ({', '.join(differ)})")
    for eps, cell in res["cells"].items():
        if eps not in into["cells"]:
            raise ValueError(f"{key}: ε = {eps} re-run with more seeds but never tuned")
        base = into["cells"][eps]["final"]
        for name, final in cell["final"].items():
            if not name.endswith("|tuned"):
                raise ValueError(f"{key}: ε = {eps}: a re-run holds {name}, not a tuned winner")
            if name not in base or base[name]["hp"] != final["hp"]:
                raise ValueError(f"{key}: ε = {eps}: {name} was re-run with other hyperparameters")
            old, new = _by_seed(base[name]), _by_seed(final)
            if not old.keys() < new.keys():
                raise ValueError(f"{key}: ε = {eps}: {name}: the re-run must add seeds to {sorted(old)}")
            moved = [s for s in old if abs(old[s] - new[s]) > 1e-9]
            if moved:
                raise ValueError(f"{key}: ε = {eps}: {name} does not reproduce seed(s) {moved} of the earlier run")
            base[name] = final
        into.setdefault("reseeded", {})[eps] = max(len(f["runs"]) for f in cell["final"].values())
    into["commands"].append(res["command"])


def merge_runs(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result per task × framework × optimizer: runs of the same one at other ε (a later
    command with ``--epsilons``) are joined cell by cell. Their settings must agree, and an ε
    may be measured once only. Each cell keeps the wall time of the file it came from.

    A run that tuned nothing (``--winners-from``) of a task × framework × optimizer that was
    tuned re-runs its winners with more seeds: its tuned final runs replace the earlier ones
    (see ``_reseed``), the tuning and the tuning-free runs stay as they were."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    # Tuned runs first, so that a re-run with more seeds always finds what it extends.
    for res in sorted(results, key=_is_reseeding):
        key = (res["task"], res["framework"], res["optimizer_name"])
        cells = {eps: {**cell, "final": dict(cell["final"]),
                       "wall_seconds": cell.get("wall_seconds", res["wall_seconds"])}
                 for eps, cell in res["cells"].items()}  # fmt: skip
        if key not in merged:
            merged[key] = {**res, "cells": cells, "commands": [res["command"]]}
            continue
        into = merged[key]
        if _is_reseeding(res) and not _is_reseeding(into):
            _reseed(into, {**res, "cells": cells}, key)
            continue
        differ = [k for k in _SETTINGS if into.get(k) != res.get(k)]
        if differ:
            raise ValueError(f"{key}: runs with different settings cannot be joined ({', '.join(differ)})")
        twice = sorted(set(into["cells"]) & set(cells), key=float)
        if twice:
            raise ValueError(f"{key}: ε = {', '.join(twice)} measured in two runs")
        into["cells"] = dict(sorted({**into["cells"], **cells}.items(), key=lambda kv: float(kv[0])))
        into["epsilons"] = sorted(float(e) for e in into["cells"])
        into["commands"].append(res["command"])
    return list(merged.values())


def report(results: list[dict[str, Any]], plots: Path | None = None) -> str:
    results = merge_runs(results)
    torch_results = [r for r in results if r["framework"] == "torch"]
    parts = ["#### Settings (σ and κ = 0.48·d·σ²/B̄² per cell)", "", settings_table(results), "",
             "#### Equal budget: test accuracy (%, mean ± SE over seeds; bold: best in the row)", "",
             equal_budget_table(results), ""]  # fmt: skip
    reseeded = [f"{_label(r)} at ε = {', '.join(f'{float(e):g}' for e in r['reseeded'])} "
                f"({'/'.join(sorted({str(n) for n in r['reseeded'].values()}))} seeds)"
                for r in results if r.get("reseeded")]  # fmt: skip
    if reseeded:
        parts += ["Tuned winners re-run with more seeds (the equal-budget and target-1 tables use them; "
                  "the tuning-free comparison pairs on the seeds both have): " + "; ".join(reseeded) + ".", ""]  # fmt: skip
    t1, v1 = target1_table(torch_results)
    parts += ["#### Target 1: Δ vs the best baseline of the cell (points, paired mean ± SE)", "", t1, "",
              "Verdicts: " + summary(v1), ""]  # fmt: skip
    tf, v2 = tuning_free_table(torch_results)
    parts += ["#### Target 2 (tuning-free): Δ of each method's default (C = 1, lr tuned) vs flat tuned over lr × C "
              "(points, paired; italic: behind by more than 1 SE)", "", tf, "", "Verdicts: " + summary(v2), ""]  # fmt: skip
    best, means = recommended(torch_results)
    parts += ["#### Validation scores of the tuning-free configurations (mean over cells)", "",
              "| method | mean validation score |", "|---|---|"]  # fmt: skip
    parts += [f"| {m} | {100 * s:.2f} |" for m, s in sorted(means.items(), key=lambda kv: -kv[1])]
    parts += ["", "Best on validation without tuning: " + "; ".join(f"{k}: **{m}**" for k, m in best.items())]
    jax_results = [r for r in results if r["framework"] == "jax"]
    if jax_results:
        parts += ["", "#### PyTorch vs JAX at the same winners (test accuracy, %)", "",
                  "| task | optimizer | ε | method | PyTorch | JAX |", "|---|---|---|---|---|---|"]  # fmt: skip
        by_key = {(r["task"], r["optimizer_name"]): r for r in torch_results}
        for jr in jax_results:
            tr = by_key.get((jr["task"], jr["optimizer_name"]))
            for eps, cell in jr["cells"].items():
                for key, f in cell["final"].items():
                    t = tr["cells"][eps]["final"].get(key) if tr else None
                    parts.append(f"| {jr['task']} | {jr['optimizer_name']} | {float(eps):g} | {key.split('|')[0]} | "
                                 f"{_mean_se(t) if t else '—'} | {_mean_se(f)} |")  # fmt: skip
    if plots is not None:
        for p in plot(results, plots):
            parts.append(f"\nwrote {p}")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> str:
    """Print the report of the given result JSONs (or, with ``--write``, write it to a file)."""
    p = argparse.ArgumentParser(description="Tables and plots of round-two utility result JSONs")
    p.add_argument("files", type=Path, nargs="+", help="round2_*.json result files")
    p.add_argument("--plots", type=Path, default=None, help="write the plots into this folder")
    p.add_argument("--write", type=Path, default=None,
                   help="write the tables to this Markdown file instead of printing them "
                        "(e.g. benchmarks/results/utility_round2_report.md)")
    args = p.parse_args(argv)
    text = report([json.loads(f.read_text()) for f in args.files], plots=args.plots)
    if args.write is None:
        print(text)
    else:
        args.write.write_text(text + "\n")
        print(f"wrote {args.write}")
    return text


if __name__ == "__main__":
    main()
