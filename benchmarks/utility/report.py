"""Print Markdown tables of utility-benchmark result JSONs (for benchmarks/results/utility_round1.md).

    python benchmarks/utility/report.py benchmarks/results/utility_digits-mlp_torch.json ...
    python benchmarks/utility/report.py --compare TORCH.json JAX.json
    python benchmarks/utility/report.py --summary MAIN.json[:ADACLIP_ON_FLAT_GRID.json] ...
    python benchmarks/utility/report.py --twins MAIN.json[:ADACLIP_ON_FLAT_GRID.json] ...
    python benchmarks/utility/report.py --adaptive-twins TWINS.json ...   # run.py --methods flat ada-...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from methods_round1 import PRIVATE_METHODS  # noqa: E402

from adaclip.strategies import noise_drift_number  # noqa: E402


def table(out: dict[str, Any]) -> str:
    """Markdown table: rows ε (target, and the most any private run's accountant reported),
    columns methods, cells mean ± std (test)."""
    methods = [m for m in PRIVATE_METHODS if any(k.startswith(m + "@") for k in out["final"])]
    head = "| ε | σ | ε spent | " + " | ".join(methods) + " | non-private |"
    lines = [head, "|" + "---|" * (len(methods) + 4)]
    nonpriv = out["final"].get("nonprivate")
    np_cell = f"{nonpriv['test']['mean']:.4f} ± {nonpriv['test']['std']:.4f}" if nonpriv else "—"
    for eps in out["epsilons"]:
        cells, sigma, spent = [], None, None
        best = max((out["final"][f"{m}@{eps}"]["test"]["mean"] for m in methods), default=None)
        for m in methods:
            f = out["final"][f"{m}@{eps}"]
            sigma = f["sigma"]
            if f.get("epsilon_spent") is not None:  # the accountant's ε, max over the seeds
                spent = max(spent or 0.0, f["epsilon_spent"])
            c = f"{f['test']['mean']:.4f} ± {f['test']['std']:.4f}"
            cells.append(f"**{c}**" if f["test"]["mean"] == best else c)
        spent_cell = "—" if spent is None else f"{spent:.3f}"
        lines.append(f"| {eps:g} | {sigma:.3f} | {spent_cell} | " + " | ".join(cells) + f" | {np_cell} |")
    return "\n".join(lines)


def winners_table(out: dict[str, Any]) -> str:
    lines = ["| method @ ε | configuration picked on validation | validation mean |", "|---|---|---|"]
    for key, w in out["winners"].items():
        hp = ", ".join(f"{k}={v:g}" for k, v in w["hp"].items())
        src = " (reused)" if "reused_from" in w else (f" (twin of {w['twin_of']})" if "twin_of" in w else "")
        lines.append(f"| {key} | {hp} | {w['val_mean']:.4f}{src} |")
    return "\n".join(lines)


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


# --------------------------------------------------------------------------- adaptive twins

DIAG_KEYS = ("q90_q10", "between", "moved", "level", "centre")
SCALE_MOVES = 0.05  # "the scale adapts": b moved ≥ 5 % from its start (‖b − b⁰‖/‖b⁰‖), median over seeds


def _twin_methods(out: dict) -> list[str]:
    methods = out.get("twins", {}).get("methods", [])
    return [m for m in methods if any(k.startswith(m + "@") for k in out["final"])]


def paired(out: dict, method: str, eps: float) -> dict | None:
    """Paired difference (method − flat) of the test metric over the seeds both ran: mean, SE
    of the paired differences (sample std/√n), the seeds where the method is ahead, and the
    median over seeds of each scale-diagnostic entry."""
    f, t = out["final"].get(f"flat@{eps}"), out["final"].get(f"{method}@{eps}")
    if f is None or t is None:
        return None
    by_seed = {r["seed"]: r["metric"] for r in f["runs"]}
    runs = [r for r in t["runs"] if r["seed"] in by_seed]
    d = np.array([r["metric"] - by_seed[r["seed"]] for r in runs])
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    diag = {k: float(np.median([r["diagnostic"][k] for r in runs if "diagnostic" in r] or [np.nan]))
            for k in DIAG_KEYS}  # fmt: skip
    return {"mean": float(d.mean()), "se": se, "n": len(d), "ahead": int((d > 0).sum()),
            "test": t["test"], "diag": diag}  # fmt: skip


def _cell_label(out: dict, eps: float) -> str:
    return f"{out['task']} {out.get('optimizer_name', 'sgd')} ε={eps:g}"


def _delta(p: dict | None) -> str:
    """``Δ ± SE`` in accuracy points; bold where |Δ| > 2 SE."""
    if p is None:
        return "—"
    text = f"{100 * p['mean']:+.1f} ± {100 * p['se']:.1f}"
    return f"**{text}**" if p["se"] > 0 and abs(p["mean"]) > 2 * p["se"] else text


def adaptive_twins_headline(outs: list[dict]) -> str:
    """Methods × (task, optimizer, ε): mean paired test difference to flat clipping ± SE, in
    accuracy points (bold: beyond 2 SE, either sign); the last row is flat's own test mean."""
    cells = [(o, e) for o in outs for e in o["epsilons"]]
    methods = list(dict.fromkeys(m for o in outs for m in _twin_methods(o)))
    head = "| method | " + " | ".join(_cell_label(o, e) for o, e in cells) + " |"
    lines = [head, "|---|" + "---|" * len(cells)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(_delta(paired(o, m, e)) for o, e in cells) + " |")
    flat = [o["final"][f"flat@{e}"]["test"] for o, e in cells]
    lines.append("| *flat (test acc, %)* | " + " | ".join(f"{100 * f['mean']:.1f} ± {100 * f['std']:.1f}" for f in flat)
                 + " |")  # fmt: skip
    return "\n".join(lines)


def adaptive_twins_diagnostics(outs: list[dict]) -> str:
    """Per method, the range over the (task, optimizer, ε) cells of the median-over-seeds scale
    diagnostic of the final state (``utility_train.scale_diagnostic``), and in how many cells the
    scale moved ≥ 5 % from its start."""
    cells = [(o, e) for o in outs for e in o["epsilons"]]
    methods = list(dict.fromkeys(m for o in outs for m in _twin_methods(o)))
    lines = ["| method | b spread q90/q10 | between tensors max/min | moved ‖b−b⁰‖/‖b⁰‖ | level mean b/b⁰ "
             "| centre ‖a/b‖ | cells where b moved ≥ 5 % |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for m in methods:
        ps = [p for p in (paired(o, m, e) for o, e in cells) if p is not None]
        rng = []
        for k in DIAG_KEYS:
            v = [p["diag"][k] for p in ps]
            lo, hi = min(v), max(v)
            rng.append(f"{lo:.3g}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}–{hi:.3g}")
        moved = sum(p["diag"]["moved"] >= SCALE_MOVES for p in ps)
        lines.append(f"| {m} | " + " | ".join(rng) + f" | {moved} of {len(ps)} |")
    return "\n".join(lines)


def adaptive_twins_block(out: dict) -> str:
    """One run's detail: flat's winner, σ and κ per ε, then every twin's test metric, paired
    difference, seeds ahead and diagnostic."""
    d = _num_params(out)
    lines = [f"#### {out['task']}, {out['optimizer']}", "",
             f"Command: `{out['command']}` — {out['date']}, {out['wall_seconds']:.0f} s wall. "
             f"{out['epochs']} epochs, B̄ = {out['expected_batch_size']:g}, d = {d}, tuning seeds "
             f"{out['tune_seeds']}, final seeds {out['seeds']}; flat grid: "
             + "; ".join(grid_lines(out).splitlines()[:1]).lstrip("- ") + ".", ""]  # fmt: skip
    lines += ["| ε | σ | κ | flat's winner (val) | method | test mean ± std | Δ vs flat ± SE | seeds ahead "
              "| q90/q10 | between | moved | level | ‖a/b‖ |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for eps in out["epsilons"]:
        f = out["final"][f"flat@{eps}"]
        w = out["winners"][f"flat@{eps}"]
        kappa = noise_drift_number(d, f["sigma"], out["expected_batch_size"])
        win = f"lr={w['hp']['lr']:g}, C={w['hp']['max_grad_norm']:g} ({w['val_mean']:.3f})"
        lines.append(f"| {eps:g} | {f['sigma']:.3f} | {kappa:.2f} | {win} | flat | {_cell(f)} | — | — | | | | | |")
        for m in _twin_methods(out):
            p = paired(out, m, eps)
            if p is None:
                continue
            g = p["diag"]
            lines.append(f"| | | | | {m} | {p['test']['mean']:.4f} ± {p['test']['std']:.4f} | {_delta(p)} | "
                         f"{p['ahead']} of {p['n']} | {g['q90_q10']:.3g} | {g['between']:.3g} | {g['moved']:.3g} | "
                         f"{g['level']:.3g} | {g['centre']:.3g} |")  # fmt: skip
    return "\n".join(lines)


def _pairs(args: list[str]) -> list[tuple[dict, dict | None]]:
    pairs = []
    for arg in args:
        main_path, _, alt_path = arg.partition(":")
        alt = json.loads(Path(alt_path).read_text()) if alt_path else None
        pairs.append((json.loads(Path(main_path).read_text()), alt))
    return pairs


if __name__ == "__main__":
    if sys.argv[1] == "--adaptive-twins":
        outs = [json.loads(Path(p).read_text()) for p in sys.argv[2:]]
        print(adaptive_twins_headline(outs), "", adaptive_twins_diagnostics(outs), sep="\n")
        for o in outs:
            print("", adaptive_twins_block(o), sep="\n")
        raise SystemExit
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
