"""Tables of the round-three utility benchmark, from its result JSONs::

    python benchmarks/utility/report_round3.py benchmarks/results/round3_*.json [--write MD]

(``round3.py --report FILES`` runs the same.) The tables of the recorded runs are in
``benchmarks/results/utility_round3.md``. Every Δ is paired by seed against tuned ``flat``
(round two's reading: ahead if Δ ≥ 2 SE, behind if Δ < −1 SE); U1 reads the recommended
configuration against the best baseline of its cell. Imports no framework.
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

from methods_round3 import BASELINES, FLAT_RECOMMENDED, RECOMMENDED, pick_clipping  # noqa: E402


def paired(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Δ = mean over shared seeds of 100·(a − b) and its standard error."""
    ra, rb = ({r["seed"]: r["metric"] for r in f["runs"]} for f in (a, b))
    common = sorted(ra.keys() & rb.keys())
    d = 100.0 * np.array([ra[s] - rb[s] for s in common])
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan
    return float(d.mean()), se


def verdict(delta: float, se: float) -> str:
    """ahead if Δ ≥ 2 SE, behind if Δ < −1 SE, else ≈ (round two's rule)."""
    if math.isnan(se) or se == 0.0:
        return "ahead" if delta > 0 else ("≈" if delta == 0 else "behind")
    return "ahead" if delta >= 2 * se else ("behind" if delta < -se else "≈")


def report(results: list[dict[str, Any]]) -> str:
    out = []
    for res in sorted(results, key=lambda r: (r["task"], r["optimizer_name"], float(next(iter(r["cells"]))))):
        for eps, cell in res["cells"].items():
            n = len(res["seeds"])
            steps = cell["final"][next(iter(cell["final"]))]["steps"]
            other = [m for m, f in cell["final"].items() if f["steps"] != steps]  # e.g. blt: epochs·⌈N/B⌉
            others = f" ({', '.join(other)}: {cell['final'][other[0]]['steps']})" if other else ""
            out.append(f"**{res['task']} | {res['optimizer_name']} at ε = {float(eps):g}** ({n} seeds, "
                       f"{steps} steps{others}, cell wall time "
                       f"{cell['wall_seconds'] / 60:.0f} min)\n\n`{res['command']}`\n")  # fmt: skip
            out.append(
                "| method | lr | C | μ | b | σ | test acc. % (± SE) | Δ vs flat (± SE) | reading | ε spent | s/run |"
            )
            out.append("|---|---|---|---|---|---|---|---|---|---|---|")
            base = cell["final"].get("flat")
            for method, f in cell["final"].items():
                m = 100.0 * np.array([r["metric"] for r in f["runs"]])
                se = m.std(ddof=1) / math.sqrt(len(m)) if len(m) > 1 else math.nan
                if base is None or method == "flat":
                    delta_s, read = "—", "baseline" if method == "flat" else "—"
                else:
                    d, dse = paired(f, base)
                    delta_s, read = f"{d:+.1f} ± {dse:.1f}", verdict(d, dse)
                name = method + (" (b tuned: larger budget)" if method.startswith("banded-grid") else "")
                out.append(f"| {name} | {f['hp']['lr']:g} | {f['hp']['max_grad_norm']:g} | "
                           f"{'—' if f['mu'] is None else f['mu']} | {f['bands']} | {f['sigma']:.3f} | "
                           f"{m.mean():.1f} ± {se:.1f} | {delta_s} | {read} | {f['epsilon_spent']:.3f} | "
                           f"{f['seconds_per_run']:.0f} |")  # fmt: skip
            if any(m.startswith("blt") for m in cell["final"]):
                out.append("\nblt: fixed-order batches, b = ⌈N/B⌉ batches an epoch (the min separation), σ "
                           "calibrated with no amplification by sampling (flat and banded: Poisson / cyclic Poisson)")
            for recommended in RECOMMENDED:
                u1 = u1_reading(cell, recommended)
                if u1 is not None:
                    out.append(f"\nU1: {recommended} vs the best baseline ({u1['baseline']}, the highest test mean "
                               f"of {', '.join(b for b in BASELINES if b in cell['final'])}): "
                               f"{u1['delta']:+.1f} ± {u1['se']:.1f} points, {u1['reading']}")  # fmt: skip
            picked = pick_clipping(cell)
            u1 = None if picked is None else u1_reading(cell, picked)
            if u1 is not None:
                out.append(f"\nU1 with the clipping picked on validation (flat or quantile rule, both with the "
                           f"recommended noise plan; twice the grid): {picked}, {u1['delta']:+.1f} ± {u1['se']:.1f} "
                           f"points vs {u1['baseline']}, {u1['reading']}")  # fmt: skip
            scaled = {k.split("|")[0]: p["lr_scale"] for k, p in cell.get("plans", {}).items()
                      if p.get("lr_scale", 1.0) != 1.0}  # fmt: skip
            for kind, rho in scaled.items():
                out.append(f"\n{kind}: the lr column is the grid's; the runs trained at ρ·lr, ρ = {rho:.2f} "
                           "(adaptive_lr_scale)")  # fmt: skip
            if "reused" in cell:
                files = " and ".join(f"`{name}`" for name in cell["reused"]["file"].split(", "))
                out.append(f"\n{', '.join(cell['reused']['methods'])}: copied from {files} "
                           "(the same runs: same grid, seeds and epochs)")
            out.append("")
    return "\n".join(out)


def u1_reading(cell: dict[str, Any], recommended: str = "recommended") -> dict[str, Any] | None:
    """The recommended configuration (or its variant ``recommended``) against the best tuned baseline of the cell (the one with
    the highest test mean: the hardest comparison for the recommendation), paired by seed;
    ``None`` unless the cell has ``recommended`` and at least one baseline."""
    final = cell["final"]
    present = [b for b in BASELINES if b in final]
    if recommended not in final or not present:
        return None
    best = max(present, key=lambda b: float(np.mean([r["metric"] for r in final[b]["runs"]])))
    d, se = paired(final[recommended], final[best])
    return {"baseline": best, "delta": d, "se": se, "reading": verdict(d, se)}


#: the other methods the summary reads against the best baseline, when a cell has them
SUMMARY_EXTRAS = ("adaclip+banded+ema", "blt+ema")


def summary(results: list[dict[str, Any]]) -> str:
    """One row per cell: the U1 reading of the library's defaults (the first of
    :data:`FLAT_RECOMMENDED` the cell has), of the recommended configuration with its clipping
    picked on validation (:func:`pick_clipping`), and of :data:`SUMMARY_EXTRAS`, each against the
    best baseline the cell has (the highest test mean of :data:`BASELINES`), with the tallies.
    Where several files hold the same cell, their methods are merged (a method from the last file
    that has it; every run is deterministic given its seed), over the files whose grid, seeds,
    tuning seeds and epochs are the cell's most common ones (a one-point grid of a special run
    is left out)."""
    found: dict[tuple[str, str, str, float, Any], list[tuple[str, dict[str, Any]]]] = {}
    for res in results:
        setup = json.dumps([res.get(k) for k in ("grid", "seeds", "tune_seeds", "epochs")])
        for eps, cell in res["cells"].items():
            key = (res["task"], res.get("framework", "torch"), res["optimizer_name"], float(eps), res.get("epochs"))
            found.setdefault(key, []).append((setup, cell))
    cells: dict[tuple[str, str, str, float, Any], dict[str, Any]] = {}
    for key, entries in found.items():
        setups = [setup for setup, _ in entries]
        common = max(setups, key=setups.count)
        merged: dict[str, Any] = {"final": {}, "winners": {}}
        for setup, cell in entries:
            if setup == common:
                merged["final"].update(cell["final"])
                merged["winners"].update(cell.get("winners", {}))
        cells[key] = merged
    header = ["cell", "baselines run", "best baseline", "b", "defaults (flat clipping)",
              "clipping picked on validation", *SUMMARY_EXTRAS]  # fmt: skip
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    tallies: dict[str, dict[str, int]] = {"defaults": {}, "picked": {}}

    def shown(u1: dict[str, Any] | None, label: str = "") -> str:
        if u1 is None:
            return "not run"
        return f"{label}{u1['delta']:+.1f} ± {u1['se']:.1f} {u1['reading']}"

    epochs_of: dict[str, set[Any]] = {}
    for task, _, _, _, epochs in cells:
        epochs_of.setdefault(task, set()).add(epochs)
    for (task, framework, optimizer, eps, epochs), cell in sorted(cells.items(), key=lambda kv: str(kv[0])):
        final = cell["final"]
        defaults = next((m for m in FLAT_RECOMMENDED if m in final), None)
        u1_default = None if defaults is None else u1_reading(cell, defaults)
        picked = pick_clipping(cell) or defaults
        u1_picked = None if picked is None else u1_reading(cell, picked)
        for name, u1 in (("defaults", u1_default), ("picked", u1_picked)):
            if u1 is not None:
                tallies[name][u1["reading"]] = tallies[name].get(u1["reading"], 0) + 1
        extras = [shown(u1_reading(cell, m)) if m in final else "not run" for m in SUMMARY_EXTRAS]
        best = None if u1_default is None else u1_default["baseline"]
        bands = final[defaults]["bands"] if defaults else "—"
        where = ("" if framework == "torch" else f" ({framework})") + (
            f" ({epochs} epoch{'' if epochs == 1 else 's'})" if len(epochs_of[task]) > 1 else ""
        )
        label = "quantile: " if picked == "recommended-quantile" else "flat: "
        out.append(f"| {task}{where}, {optimizer}, ε = {eps:g} | {', '.join(b for b in BASELINES if b in final)} | "
                   f"{best or '—'} | {bands} | {shown(u1_default)} | {shown(u1_picked, label)} | "
                   f"{' | '.join(extras)} |")  # fmt: skip
    for name, counts in tallies.items():
        out.append(f"\n{name}: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in ("ahead", "≈", "behind"))
                   + f" ({sum(counts.values())} cells)")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    """Print the tables of the given result JSONs (or, with ``--write``, write them to a file)."""
    p = argparse.ArgumentParser(description="Tables of round-three utility result JSONs")
    p.add_argument("files", type=Path, nargs="+", help="round3_*.json result files")
    p.add_argument("--write", type=Path, default=None,
                   help="write the tables to this Markdown file instead of printing them "
                        "(e.g. benchmarks/results/utility_round3_report.md)")
    p.add_argument("--summary", action="store_true",
                   help="one row per cell (the U1 readings of the defaults, the clipping picked on validation, "
                        "AdaClip()+banded+EMA and BLT+EMA) instead of the per-cell tables")
    args = p.parse_args(argv)
    results = [json.loads(f.read_text()) for f in args.files]
    text = summary(results) if args.summary else report(results)
    if args.write is None:
        print(text)
    else:
        args.write.write_text(text + "\n")
        print(f"wrote {args.write}")
    return text


if __name__ == "__main__":
    main()
