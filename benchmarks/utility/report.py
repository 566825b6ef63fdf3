"""Print Markdown tables of utility-benchmark result JSONs (for benchmarks/RESULTS.md).

    python benchmarks/utility/report.py benchmarks/results/utility_digits-mlp_torch.json ...
    python benchmarks/utility/report.py --compare TORCH.json JAX.json
    python benchmarks/utility/report.py --summary MAIN.json[:ADACLIP_ON_FLAT_GRID.json] ...
    python benchmarks/utility/report.py --twins MAIN.json[:ADACLIP_ON_FLAT_GRID.json] ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import table, winners_table  # noqa: E402

from adaclip.strategies import noise_drift_number  # noqa: E402


def grid_lines(out: dict) -> str:
    lines = []
    ran = {key.split("@")[0] for key in out["final"]}
    for m, g in out["grids"].items():
        if not g or m not in ran:  # grids of methods this run did not train (--methods)
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


def _cell(f: dict | None) -> str:
    return "—" if f is None else f"{f['test']['mean']:.4f} ± {f['test']['std']:.4f}"


def _gap(x: dict, y: dict) -> str:
    """``x − y`` and that difference in standard errors of the difference."""
    a, b = x["test"], y["test"]
    se = (a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"]) ** 0.5
    d = a["mean"] - b["mean"]
    return f"{d:+.4f} ({d / se:+.1f} SE)" if se > 0 else f"{d:+.4f}"


def summary(pairs: list[tuple[dict, dict | None]]) -> str:
    """One row per task and ε: flat clipping, AdaCliP on its own (C0, β2) grid, AdaCliP on flat
    clipping's exact (lr, C) grid (``--ada-grid flat-clips``, when given), the best of the
    other two private methods, the non-private baseline, and the gap of the better AdaCliP
    (picked by *validation* score, never by test) to flat clipping."""
    lines = [
        "| task | ε | flat | AdaCliP (own grid) | AdaCliP (flat's grid) | best of per-layer / eDP-SGD "
        "| non-private | AdaCliP − flat |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for main, alt in pairs:
        fin = main["final"]
        for eps in main["epsilons"]:
            flat = fin[f"flat@{eps}"]
            own = fin.get(f"adaclip@{eps}")
            other = alt["final"].get(f"adaclip@{eps}") if alt else None
            rest = [fin[k] for k in (f"per_layer@{eps}", f"scaled@{eps}") if k in fin]
            best_rest = max(rest, key=lambda f: f["test"]["mean"], default=None)
            cands = [(main["winners"][f"adaclip@{eps}"]["val_mean"], own)] if own else []
            if other:
                cands.append((alt["winners"][f"adaclip@{eps}"]["val_mean"], other))
            picked = max(cands, key=lambda c: c[0])[1] if cands else None
            lines.append(
                f"| {main['task']} | {eps:g} | {_cell(flat)} | {_cell(own)} | {_cell(other)} | "
                f"{_cell(best_rest)} | {_cell(fin.get('nonprivate'))} | "
                f"{_gap(picked, flat) if picked else '—'} |"
            )
    return "\n".join(lines)


def _num_params(out: dict) -> int:
    """d of the run's model (results recorded before ``num_params`` was stored: from the task)."""
    if "num_params" in out:
        return int(out["num_params"])
    from utility_tasks import load_task, n_params

    return n_params(load_task(out["task"]).make_model(0))


def twins(pairs: list[tuple[dict, dict | None]]) -> str:
    """Paired validation scores: every flat configuration ``(lr, C)`` against its AdaCliP twin
    ``(lr, C0 = C)`` of the ``--ada-grid flat-clips`` run (same order of the grid), so the
    comparison does not depend on which configuration won. Without a second file, the first
    must hold both (a run with ``--methods flat adaclip --ada-grid flat-clips``)."""
    lines = ["| task | B̄ | ε | κ | twins where AdaCliP > flat | mean (AdaCliP − flat) | min | max |",
             "|---|---|---|---|---|---|---|---|"]
    for main, alt in pairs:
        alt = alt or main
        for eps in main["epsilons"]:
            flat = main["tuning"][f"flat@{eps}"]
            ada = alt["tuning"][f"adaclip@{eps}"]
            if len(flat) != len(ada) or any(f["hp"]["lr"] != a["hp"]["lr"] for f, a in zip(flat, ada)):
                raise SystemExit(f"{main['task']}: the AdaCliP run was not made on flat clipping's grid")
            diffs = [a["val_mean"] - f["val_mean"] for f, a in zip(flat, ada)]
            wins = sum(d > 0 for d in diffs)
            bbar = main["expected_batch_size"]
            kappa = f"{noise_drift_number(_num_params(main), main['final'][f'flat@{eps}']['sigma'], bbar):.2f}"
            lines.append(f"| {main['task']} | {bbar:g} | {eps:g} | {kappa} | {wins} of {len(diffs)} | "
                         f"{sum(diffs) / len(diffs):+.4f} | {min(diffs):+.4f} | {max(diffs):+.4f} |")
    return "\n".join(lines)


def _pairs(args: list[str]) -> list[tuple[dict, dict | None]]:
    pairs = []
    for arg in args:
        main_path, _, alt_path = arg.partition(":")
        alt = json.loads(Path(alt_path).read_text()) if alt_path else None
        pairs.append((json.loads(Path(main_path).read_text()), alt))
    return pairs


if __name__ == "__main__":
    if sys.argv[1] == "--twins":
        print(twins(_pairs(sys.argv[2:])))
        raise SystemExit
    if sys.argv[1] == "--summary":
        print(summary(_pairs(sys.argv[2:])))
        raise SystemExit
    if sys.argv[1] == "--compare":
        print(compare(*(json.loads(Path(p).read_text()) for p in sys.argv[2:4])))
        raise SystemExit
    for p in sys.argv[1:]:
        print(block(json.loads(Path(p).read_text())))
