"""U1 with the validation pick counted in ε: what the tuned configurations cost when the
selection is a differentially private one.

Round three's U1 cells (``benchmarks/results/round3_*_u1.json``) tune every method on a
validation split: the baselines (flat, quantile and per-layer clipping, each over the same
lr × C grid) and the recommended configuration (banded noise at the library's b over that grid,
its averaging — none or μ ∈ {0.9, 0.99, 0.999} — picked on validation; with its clipping picked
too, flat or the quantile rule, the grid is twice as large). Their reported ε is one run's:
right when the validation split is public, not when it is private.

This script accounts the pick as :func:`adaclip.accounting.selection_epsilon` does
(Papernot & Steinke's repeat-and-select: a random number of trials, geometric with mean = the
number of candidate configurations, each trial one run of the cell's plan, only the best
released). The averaging's μ is chosen inside a trial (post-processing of that trial's run),
so it adds no candidate; the score is read from a validation split that is public, or private
with its count of correct predictions released with Gaussian noise
(``--score-noise``, sensitivity 1; the trial is then the run composed with that release).
No training: it reads the plans (σ, q, T, b) recorded in each cell.

    python benchmarks/utility/u1_selection_cost.py --out benchmarks/results/utility_u1_selection_cost.md
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path
from typing import Any

from adaclip.accounting import probability_never_tried, selection_epsilon

RESULTS = Path(__file__).resolve().parents[1] / "results"
BASELINES = ("flat", "quantile", "per-layer")


def cells() -> list[dict[str, Any]]:
    """One row per U1 cell: the task, optimizer, ε, δ, the grid size, the baselines present, and
    the flat and banded plans."""
    rows = []
    for path in sorted(glob.glob(str(RESULTS / "round3_*_u1.json"))):
        data = json.loads(Path(path).read_text())
        for eps, cell in data["cells"].items():
            plans = cell["plans"]
            rows.append({
                "file": Path(path).name, "task": data["task"], "optimizer": data.get("optimizer_name", data["optimizer"]),
                "epsilon": float(eps),
                "delta": data["delta"], "grid": len(data["grid"]),
                "baselines": [m for m in BASELINES if m in data["methods"]],
                "flat": plans["flat|1"], "banded": plans["banded|None"],
            })  # fmt: skip
    return rows


def _eps(plan: dict[str, Any], delta: float, trials: int, score_noise: float | None) -> float:
    return selection_epsilon(noise_multiplier=plan["sigma"], sample_rate=plan["q"], steps=plan["steps"],
                             delta=delta, mean_trials=float(trials), bands=plan["bands"],
                             score_noise_multiplier=score_noise)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--score-noise", type=float, default=None,
                    help="σ of the Gaussian noise on the validation count (a private split); default: public split")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    command = "python benchmarks/utility/u1_selection_cost.py" + "".join(f" {x}" for x in (argv if argv is not None else sys.argv[1:]))
    lines = [
        "| cell | ε of one run (reported) | baselines: candidates → ε counted | recommended: 4 → ε | "
        "recommended, clipping picked too: 8 → ε |",
        "|---|---|---|---|---|",
    ]
    ratios, not_above = [], [0, 0]
    for c in cells():
        n_base = c["grid"] * len(c["baselines"])
        e_base = _eps(c["flat"], c["delta"], n_base, a.score_noise)
        e_rec = _eps(c["banded"], c["delta"], c["grid"], a.score_noise)
        e_rec2 = _eps(c["banded"], c["delta"], 2 * c["grid"], a.score_noise)
        ratios.append((e_base / c["epsilon"], e_rec / c["epsilon"], e_rec2 / c["epsilon"]))
        not_above[0] += e_rec <= e_base
        not_above[1] += e_rec2 <= e_base
        lines.append(
            f"| {c['task']} {c['optimizer']} | {c['epsilon']:g} | {n_base} ({'+'.join(c['baselines'])}) → "
            f"{e_base:.2f} | {e_rec:.2f} | {e_rec2:.2f} |"
        )
    never = [probability_never_tried(num_candidates=k, mean_trials=float(k)) for k in (4, 8, 12)]
    lo = [min(r[i] for r in ratios) for i in range(3)]
    hi = [max(r[i] for r in ratios) for i in range(3)]
    head = [
        "# U1 with the validation pick counted in ε (repeat-and-select)", "",
        "```", command, "```", "",
        "Computed, not trained: each cell's recorded plans (σ, q, T, b) and the number of candidate",
        "configurations each method was tuned over; δ as in the cell. The number of trials is geometric",
        "with mean = the number of candidates; the averaging's μ is picked inside a trial. Score read",
        ("from a public validation split." if a.score_noise is None else
         f"from a private validation split: its count of correct predictions + N(0, {a.score_noise:g}²)."), "",
    ]  # fmt: skip
    tail = [
        "", "## Reading", "",
        f"- Counting the pick multiplies ε by {lo[0]:.2f}–{hi[0]:.2f} for the baselines (4–12 candidates), "
        f"{lo[1]:.2f}–{hi[1]:.2f} for the recommended configuration with flat clipping (4) and "
        f"{lo[2]:.2f}–{hi[2]:.2f} with its clipping picked too (8), over the {len(ratios)} cells.",
        f"- The recommended configuration's counted ε is at most the best-of-baselines' in {not_above[0]} of "
        f"{len(ratios)} cells with flat clipping (4 candidates) and in {not_above[1]} with its clipping picked too "
        "(8); elsewhere it is above, where the baseline had 4 or 8 candidates or banded noise's RDP curve is "
        "steeper at the same ε. So at the counted ε the two are no longer compared at equal ε in every cell.",
        "- What this does not give is the accuracy at the *same total ε*: every configuration retrained at the",
        "  smaller per-run ε that makes the counted total equal the target. Not run.",
        "- Repeat-and-select is not the exhaustive grid the cells ran: with a geometric number of trials with",
        f"  mean = the number of candidates, a given candidate is never tried with probability {never[0]:.0%} (4),",
        f"  {never[1]:.0%} (8) or {never[2]:.0%} (12) (`probability_never_tried`); the recorded accuracies, picked",
        "  from every candidate, do not include that loss.",
    ]
    text = "\n".join(head + lines + tail) + "\n"
    print(text)
    if a.out is not None:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
