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

from methods_round3 import BASELINES, RECOMMENDED, pick_clipping  # noqa: E402


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


def main(argv: list[str] | None = None) -> str:
    """Print the tables of the given result JSONs (or, with ``--write``, write them to a file)."""
    p = argparse.ArgumentParser(description="Tables of round-three utility result JSONs")
    p.add_argument("files", type=Path, nargs="+", help="round3_*.json result files")
    p.add_argument("--write", type=Path, default=None,
                   help="write the tables to this Markdown file instead of printing them "
                        "(e.g. benchmarks/results/utility_round3_report.md)")
    args = p.parse_args(argv)
    text = report([json.loads(f.read_text()) for f in args.files])
    if args.write is None:
        print(text)
    else:
        args.write.write_text(text + "\n")
        print(f"wrote {args.write}")
    return text


if __name__ == "__main__":
    main()
