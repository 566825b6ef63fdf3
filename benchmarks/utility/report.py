"""Print Markdown tables of utility-benchmark result JSONs (for benchmarks/RESULTS.md).

    python benchmarks/utility/report.py benchmarks/results/utility_digits-mlp_torch.json ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import table, winners_table  # noqa: E402


def grid_lines(out: dict) -> str:
    lines = []
    for m, g in out["grids"].items():
        if not g:
            continue
        keys = sorted({k for hp in g for k in hp})
        vals = {k: sorted({hp[k] for hp in g if k in hp}) for k in keys}
        desc = "; ".join(f"{k} ∈ {{{', '.join(f'{v:g}' for v in vs)}}}" for k, vs in vals.items())
        lines.append(f"- {m} ({len(g)} configurations): {desc}")
    return "\n".join(lines)


def block(out: dict) -> str:
    v = out["versions"]
    vers = ", ".join(f"{k} {val}" for k, val in v.items())
    mode = "quick" if out["quick"] else "full"
    unit = "users" if out["user_level"] else "examples"
    extra = ""
    if out["user_level"]:
        ppl = [
            f"{k}: {f['perplexity']['mean']:.4g} ± {f['perplexity']['std']:.3g}"
            for k, f in out["final"].items() if "perplexity" in f
        ]
        extra = "\n\nTest perplexity: " + "; ".join(ppl) + "."
    return f"""### {out['task']} ({out['framework']}, {mode})

Command: `{out['command']}` — {out['date']}, {out['wall_seconds']:.0f} s wall.
{out['units_train']} training {unit} ({out['units_tune']} for tuning / {out['units_val']} validation), B̄ = {out['expected_batch_size']:g},
{out['epochs']} epochs, δ = {out['delta']:g}, optimizer {out['optimizer']}; tuning seeds {out['tune_seeds']}, final seeds {out['seeds']}.
Test {out['metric']} (mean ± std over seeds; bold = best private method):

{table(out)}{extra}

Grids:

{grid_lines(out)}

Winners (validation):

{winners_table(out)}

Versions: {vers}. Machine: {out['machine']}.
"""


def compare(a: dict, b: dict) -> str:
    """Side-by-side table of two results at the same keys (e.g. PyTorch vs JAX)."""
    lines = [f"| key | {a['framework']} | {b['framework']} | difference | combined std |", "|---|---|---|---|---|"]
    for key in a["final"]:
        if key not in b["final"]:
            continue
        x, y = a["final"][key]["test"], b["final"][key]["test"]
        comb = (x["std"] ** 2 / x["n"] + y["std"] ** 2 / y["n"]) ** 0.5
        lines.append(f"| {key} | {x['mean']:.4f} ± {x['std']:.4f} | {y['mean']:.4f} ± {y['std']:.4f} | "
                     f"{x['mean'] - y['mean']:+.4f} | {comb:.4f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        print(compare(*(json.loads(Path(p).read_text()) for p in sys.argv[2:4])))
        raise SystemExit
    for p in sys.argv[1:]:
        print(block(json.loads(Path(p).read_text())))
