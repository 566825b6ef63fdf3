"""When does ``AdaClip()`` + banded noise + EMA beat banded noise + EMA with flat clipping?
A search for a rule on public quantities, over the recorded round-three/four utility cells.

    python benchmarks/utility/adaclip_rule.py --out benchmarks/results/utility_adaclip_rule.md

No training: it reads ``benchmarks/results/round3_*.json`` and ``round4_*.json`` (the records of
:mod:`round3` / :mod:`round4`), builds each task's model once to count its parameters, and
writes a Markdown report. It runs in seconds.

**Cells.** A cell is (task, framework, optimizer, ε). It enters the analysis when its records
hold final runs of both ``adaclip+banded+ema`` (``AdaClip(max_grad_norm=C)``, the default
preset, banded noise at the library's b, EMA with μ picked on validation) and ``banded+ema``
(flat clipping, the same noise plan, EMA). Records of one cell are grouped by their protocol
(accountant, lr × C grid, seeds, tuning seeds, epochs). The **tuned** protocol (a grid of more
than one point) gives the rows that the rules are fitted and judged on; records with a one-point
grid (the main job's fixed lr = 0.2, C = 1) are listed separately as a check. Within a
protocol, the file that holds both methods is taken, preferring the tags ``_complete``, then
``_u1``, then the untagged first recording, then ``_quantile``, then any other (newest first).
Where no file holds both, the two methods are taken from two files of the same protocol (each
from the most preferred file that has it): every run is seeded, so their seeds pair, as
``round3.py --reuse`` and ``report_round3.py --summary`` assume; the row says so.

**Δ.** ``100·(acc(adaclip+banded+ema) − acc(banded+ema))`` per seed, mean over the shared seeds,
SE = sd/√n (:func:`report_round3.paired`). Label: **ahead** if Δ > 2 SE, **behind** if Δ < −1 SE,
else **level**. Δ against tuned ``flat`` (DP-SGD) is shown for context.

**Public features** (known before training, from the plan in the record and the model):
d (trainable parameters), the number of parameter tensors and the smallest one's size, B̄, q,
N = B̄/q (privacy units), T, steps per unit T·q, b, the group rate b·q, the compositions
⌈T/b⌉, σ_1 (DP-SGD's σ at the same ε) and σ_b (the banded run's), the banded noise's stationary
per-coordinate variance v = ``BandedNoise(c).variance(T − 1)``, σ_b·√v, ρ =
:func:`adaclip.correlated.coefficients.adaptive_lr_scale`, the noise-drift number
κ = :func:`adaclip.adaptive.noise_drift_number` (d, σ_b, B̄) and κ_v with σ_b·√v in place of σ_b,
the released mean's per-coordinate noise std per unit of C, σ_b·√v/B̄, its public
signal-to-noise bound B̄/(σ_b·√(v·d)) (= √(2φ(1)/κ_v), so not searched separately), the drift
law's log-growth of the std estimates over the run on noise alone, ½·T·ln(1 + (1 − β₂)(κ_v − 1))
with the default preset's β₂, and the optimizer. The clip norm C and the learning rate are
picked on validation, so σ_b·√v·C/B̄ with the tuned C is shown but kept out of the public search.

**Rules.** "Turn AdaCliP on if f > t" or "if f ≤ t" for one feature (t midway between adjacent
values), and the AND / OR of two such rules on different features. A rule's errors are the
behind cells it turns on plus the ahead cells it leaves off (level cells cost nothing). Rules
are ranked by errors, then by behind cells turned on, then by margin (the gap around the
threshold as a fraction of the feature's range, log scale for positive features; a pair's is
its smaller one). **Leave-one-out**: for each cell, the top rule fitted on the other cells
(thresholds from their values only) is applied to it; it is wrong if it turns a behind cell on
or an ahead cell off.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
sys.path.insert(0, str(HERE))

from report_round3 import paired  # noqa: E402

from adaclip.adaptive import CLAMPED_NOISE_FRACTION, noise_drift_number  # noqa: E402
from adaclip.adaptive_strategy import adaptive_clipping  # noqa: E402
from adaclip.correlated import BandedNoise  # noqa: E402
from adaclip.correlated import coefficients as band_coefficients  # noqa: E402

ADA = "adaclip+banded+ema"
BASE = "banded+ema"
FLAT = "flat"
#: file-tag preference within one protocol (lower first); any other tag ranks after these
TAG_RANK = {"_complete": 0, "_u1": 1, "": 2, "_quantile": 3}
#: the strategy AdaClip(max_grad_norm=1) builds (default preset); d only sets its std bounds
DEFAULT_STRATEGY = adaptive_clipping(1000, max_grad_norm=1.0)
BETA_STD = DEFAULT_STRATEGY.beta_std
PERMUTATIONS = 200  # label shuffles of the chance check


# --------------------------------------------------------------------------- models (d)


def model_sizes(task: str) -> dict[str, int]:
    """d, the number of trainable tensors and the smallest one's size, of the task's model,
    built as its loader builds it (no data is loaded)."""
    from tasks_round2 import TinyTransformerLM
    from torch import nn
    from utility_tasks import TiedLSTMLM, mlp

    builders = {
        "digits-mlp": lambda: mlp((64, 32, 10), nn.Tanh),  # utility_tasks.load_task
        "mnist1d-mlp": lambda: mlp((40, 100, 100, 10), nn.ReLU),  # utility_tasks.load_task
        "mnist1d-long": lambda: mlp((40, 100, 100, 10), nn.ReLU),  # tasks_round2.load_round2_task
        "lstm-users-long": lambda: TiedLSTMLM(200, 32),  # lstm-users-many: vocab 200, hidden 32
        "transformer-lm-long": lambda: TinyTransformerLM(200, 12),  # transformer-lm: vocab 200, length 12
    }
    if task not in builders:
        raise KeyError(f"no model builder for task {task!r}")
    sizes = [p.numel() for p in builders[task]().parameters() if p.requires_grad]
    return {"d": int(sum(sizes)), "tensors": len(sizes), "min_tensor": int(min(sizes))}


def model_sizes_loaded(task: str) -> int:
    """d from the task's own loader (slow: it builds the data too); ``--check-d``."""
    from round3 import load_any
    from utility_tasks import n_params

    return n_params(load_any(task).make_model(0))


# --------------------------------------------------------------------------- records


@dataclass
class Record:
    path: Path
    tag: str
    res: dict[str, Any]
    eps: float
    cell: dict[str, Any]

    @property
    def final(self) -> dict[str, Any]:
        return self.cell.get("final", {})

    @property
    def rank(self) -> tuple[int, str]:
        # preferred tag first; then the newest recording (dates are ISO strings: invert by sorting on rank tuples)
        return (TAG_RANK.get(self.tag, len(TAG_RANK)), _inverted(self.res.get("date", "")))


def _inverted(s: str) -> str:
    return "".join(chr(0x10FFFF - ord(ch)) for ch in s)


def setup_of(res: dict[str, Any]) -> str:
    return json.dumps([res.get("accountant") or "rdp", res.get("grid"), res.get("seeds"), res.get("tune_seeds"),
                       res.get("epochs")], sort_keys=True)  # fmt: skip


def load_records(paths: list[Path]) -> list[Record]:
    out = []
    for path in paths:
        res = json.loads(path.read_text())
        m = re.search(r"_eps(\d+(?:\.\d+)?)(.*)$", path.stem)
        tag = m.group(2) if m else path.stem
        for eps, cell in res.get("cells", {}).items():
            out.append(Record(path, tag, res, float(eps), cell))
    return out


@dataclass
class Cell:
    task: str
    framework: str
    optimizer: str
    eps: float
    protocol: str  # "tuned" or "fixed lr, C"
    accountant: str
    ada: Record
    base: Record
    delta: float = math.nan
    se: float = math.nan
    n: int = 0
    label: str = ""
    delta_flat: float = math.nan
    se_flat: float = math.nan
    base_vs_flat: tuple[float, float] = (math.nan, math.nan)
    val: tuple[float, float] = (math.nan, math.nan)  # validation means of the two winners (adaclip, banded+ema)
    feats: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        opt = {"sgd": "SGD", "adam": "Adam"}.get(self.optimizer, self.optimizer)
        return f"{self.task} {opt} ε={self.eps:g}"

    @property
    def source(self) -> str:
        if self.ada.path == self.base.path:
            return f"`{self.ada.path.name}`"
        return f"`{self.ada.path.name}` (adaclip) + `{self.base.path.name}` (banded+ema)"


def select_cells(records: list[Record]) -> tuple[list[Cell], list[Cell], dict[str, int]]:
    """(tuned cells, fixed-hyperparameter cells, counts) as the module docstring says."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        key = (r.res["task"], r.res.get("framework", "torch"), r.res.get("optimizer_name"), r.eps)
        groups.setdefault(key, []).append(r)
    tuned, fixed = [], []
    counts = {"files": len({r.path for r in records}), "cells": len(groups), "cells_with_adaclip": 0}
    for key, recs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        if not any(ADA in r.final for r in recs):
            continue
        counts["cells_with_adaclip"] += 1
        by_setup: dict[str, list[Record]] = {}
        for r in recs:
            by_setup.setdefault(setup_of(r.res), []).append(r)
        found: list[Cell] = []
        for setup, rs in by_setup.items():
            both = sorted((r for r in rs if ADA in r.final and BASE in r.final), key=lambda r: r.rank)
            if both:
                ada = base = both[0]
            else:
                with_ada = sorted((r for r in rs if ADA in r.final), key=lambda r: r.rank)
                with_base = sorted((r for r in rs if BASE in r.final), key=lambda r: r.rank)
                if not with_ada or not with_base:
                    continue
                ada, base = with_ada[0], with_base[0]
            grid = json.loads(setup)[1] or []
            found.append(Cell(*key, protocol="tuned" if len(grid) > 1 else "fixed lr, C",
                              accountant=json.loads(setup)[0], ada=ada, base=base))  # fmt: skip
        t = [c for c in found if c.protocol == "tuned"]
        if len(t) > 1:  # more than one tuned protocol: keep RDP (every tuned record's accountant)
            t = sorted(t, key=lambda c: c.accountant != "rdp")[:1]
        tuned += t
        fixed += [c for c in found if c.protocol != "tuned"]
    return tuned, fixed, counts


# --------------------------------------------------------------------------- Δ and features


def label_of(delta: float, se: float) -> str:
    if math.isnan(se) or se == 0.0:
        return "ahead" if delta > 0 else ("level" if delta == 0 else "behind")
    return "ahead" if delta > 2 * se else ("behind" if delta < -se else "level")


def plan_of(rec: Record, kind: str, method: str) -> dict[str, Any]:
    """The final-run plan of ``kind`` (``adaclip-banded``, ``banded`` or ``flat``) in ``rec``."""
    plans = rec.cell.get("plans", {})
    for key, plan in plans.items():
        if key.split("|")[0] == kind:
            return plan
    f = rec.final[method]  # fallback: the final run's own b and σ, square-root coefficients
    return {"bands": f["bands"], "sigma": f["sigma"], "steps": f["steps"],
            "coefficients": [float(c) for c in band_coefficients.sqrt_toeplitz_coefficients(f["bands"])]}  # fmt: skip


def measure(cell: Cell, sizes: dict[str, int]) -> None:
    fa, fb = cell.ada.final[ADA], cell.base.final[BASE]
    cell.delta, cell.se = paired(fa, fb)
    cell.n = len({r["seed"] for r in fa["runs"]} & {r["seed"] for r in fb["runs"]})
    cell.label = label_of(cell.delta, cell.se)
    if FLAT in cell.ada.final:
        cell.delta_flat, cell.se_flat = paired(fa, cell.ada.final[FLAT])
    if FLAT in cell.base.final:
        cell.base_vs_flat = paired(fb, cell.base.final[FLAT])
    wa, wb = cell.ada.cell.get("winners", {}).get(ADA), cell.base.cell.get("winners", {}).get(BASE)
    if wa and wb:
        cell.val = (float(wa["val_mean"]), float(wb["val_mean"]))
    if cell.ada.path != cell.base.path:
        cell.notes.append("the two methods come from two files of the same protocol, paired by seed")
        shared = cell.ada.final.get(FLAT), cell.base.final.get(FLAT)
        if all(shared):
            ra = [r["metric"] for r in shared[0]["runs"]]
            rb = [r["metric"] for r in shared[1]["runs"]]
            diff = 100 * max(abs(x - y) for x, y in zip(ra, rb))
            cell.notes.append(f"`flat` differs between the two files by up to {diff:.2f} points a seed")
    res = cell.ada.res
    pa = plan_of(cell.ada, "adaclip-banded", ADA)
    pb = plan_of(cell.base, "banded", BASE)
    if (pa["bands"], round(pa["sigma"], 9)) != (pb["bands"], round(pb["sigma"], 9)):
        cell.notes.append(f"different noise plans: adaclip b = {pa['bands']}, σ = {pa['sigma']:.3f}; "
                          f"banded+ema b = {pb['bands']}, σ = {pb['sigma']:.3f}")  # fmt: skip
    if fa["bands"] == 1:
        cell.notes.append("b = 1: the rule chose independent noise, so both methods are really '+ema' with DP-SGD noise")
    b, sigma, T = int(pa["bands"]), float(pa["sigma"]), int(pa.get("steps", fa["steps"]))
    coeffs = np.asarray(pa["coefficients"], dtype=float)
    if not np.allclose(coeffs, band_coefficients.sqrt_toeplitz_coefficients(b)):
        cell.notes.append("the plan's coefficients are not the square-root ones")
    bbar = float(res["expected_batch_size"])
    q = float(pa["q"])
    sigma1 = float(plan_of(cell.ada, "flat", FLAT)["sigma"]) if FLAT in cell.ada.final else math.nan
    v = BandedNoise(coeffs.tolist()).variance(T - 1)
    d = sizes["d"]
    kappa_v = noise_drift_number(d, sigma * math.sqrt(v), bbar)
    growth = 1.0 + (1.0 - BETA_STD) * (kappa_v - 1.0)
    clip = float(fa["hp"]["max_grad_norm"])
    cell.feats = {
        "adam": 1.0 if cell.optimizer == "adam" else 0.0,
        "eps": cell.eps,
        "d": float(d),
        "tensors": float(sizes["tensors"]),
        "min_tensor": float(sizes["min_tensor"]),
        "bbar": bbar,
        "q": q,
        "N": float(round(bbar / q)),
        "T": float(T),
        "Tq": T * q,
        "b": float(b),
        "bq": b * q,
        "compositions": float(-(-T // b)),
        "sigma_1": sigma1,
        "sigma_b": sigma,
        "v": v,
        "sigma_eff": sigma * math.sqrt(v),
        "rho": band_coefficients.adaptive_lr_scale(coeffs, T, sigma=sigma, sigma_independent=sigma1),
        "kappa": noise_drift_number(d, sigma, bbar),
        "kappa_v": kappa_v,
        "noise_coord": sigma * math.sqrt(v) / bbar,
        "snr": bbar / (sigma * math.sqrt(v * d)),
        "drift_T": 0.5 * T * math.log(growth),
        # not public before tuning (C picked on validation): shown, not searched
        "noise_coord_C": sigma * math.sqrt(v) * clip / bbar,
    }


#: searched features: (key, how the report writes it); snr is √(2φ(1)/κ_v), the same splits as κ_v
SEARCHED = [
    ("adam", "Adam (1) vs SGD (0)"), ("eps", "ε"), ("d", "d"), ("tensors", "tensors"),
    ("min_tensor", "smallest tensor"), ("bbar", "B̄"), ("q", "q"), ("N", "N"), ("T", "T"),
    ("Tq", "T·q"), ("b", "b"), ("bq", "b·q"), ("compositions", "⌈T/b⌉"), ("sigma_1", "σ_1"),
    ("sigma_b", "σ_b"), ("v", "v"), ("sigma_eff", "σ_b·√v"), ("rho", "ρ"), ("kappa", "κ"),
    ("kappa_v", "κ_v"), ("noise_coord", "σ_b·√v/B̄"), ("drift_T", "drift over T"),
]  # fmt: skip
NAMES = dict(SEARCHED) | {"snr": "B̄/(σ_b√(v·d))", "noise_coord_C": "σ_b·√v·C/B̄ (C tuned)"}


# --------------------------------------------------------------------------- rules


@dataclass
class Rule:
    feature: str
    op: str  # ">" or "<="
    threshold: float
    margin: float

    def on(self, x: np.ndarray) -> np.ndarray:
        return x > self.threshold if self.op == ">" else x <= self.threshold

    def text(self) -> str:
        if self.feature == "adam":
            return "optimizer is Adam" if self.op == ">" else "optimizer is SGD"
        return f"{NAMES[self.feature]} {'>' if self.op == '>' else '≤'} {fmt(self.threshold)}"


def fmt(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    a = abs(x)
    if float(x).is_integer() and a >= 1:
        return f"{int(x):,}"
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 0.01:
        return f"{x:.3g}"
    return f"{x:.2e}"


def single_rules(X: dict[str, np.ndarray], features: list[str]) -> list[Rule]:
    """Every threshold rule on one feature: t midway (geometric mean for positive values)
    between adjacent distinct values, both directions."""
    rules = []
    for f in features:
        vals = np.unique(X[f])
        if len(vals) < 2:
            continue
        positive = bool(np.all(vals > 0))
        span = (math.log(vals[-1] / vals[0]) if positive else vals[-1] - vals[0]) or 1.0
        for lo, hi in zip(vals[:-1], vals[1:]):
            t = math.sqrt(lo * hi) if positive else 0.5 * (lo + hi)
            gap = (math.log(hi / lo) if positive else hi - lo) / span
            rules += [Rule(f, ">", t, gap), Rule(f, "<=", t, gap)]
    return rules


@dataclass
class Score:
    text: str
    on: np.ndarray
    on_behind: int
    ahead_missed: int
    on_level: int
    gain: float
    margin: float
    order: int

    @property
    def errors(self) -> int:
        return self.on_behind + self.ahead_missed

    @property
    def key(self) -> tuple:
        return (self.errors, self.on_behind, -round(self.margin, 12), self.order)


def score(text: str, on: np.ndarray, labels: np.ndarray, deltas: np.ndarray, margin: float, order: int) -> Score:
    return Score(text, on, int(np.sum(on & (labels == "behind"))), int(np.sum(~on & (labels == "ahead"))),
                 int(np.sum(on & (labels == "level"))), float(np.sum(deltas[on])), margin, order)  # fmt: skip


def feature_matrix(cells: list[Cell], features: list[str]) -> dict[str, np.ndarray]:
    return {f: np.array([c.feats[f] for c in cells], dtype=float) for f in features}


def best_single(cells: list[Cell], features: list[str]) -> list[Score]:
    X = feature_matrix(cells, features)
    labels = np.array([c.label for c in cells])
    deltas = np.array([c.delta for c in cells])
    rules = single_rules(X, features)
    return sorted((score(r.text(), r.on(X[r.feature]), labels, deltas, r.margin, i) for i, r in enumerate(rules)),
                  key=lambda s: s.key)  # fmt: skip


def pair_scores(cells: list[Cell], features: list[str]) -> tuple[list[Rule], np.ndarray, dict[str, np.ndarray]]:
    """The single rules, their on-matrix S (rules × cells), and for AND and OR the matrices of
    behind-on, ahead-missed and margin over rule pairs on different features (i < j)."""
    X = feature_matrix(cells, features)
    labels = np.array([c.label for c in cells])
    rules = single_rules(X, features)
    S = np.array([r.on(X[r.feature]) for r in rules], dtype=float)
    behind = (labels == "behind").astype(float)
    ahead = (labels == "ahead").astype(float)
    feat = np.array([r.feature for r in rules])
    margin = np.array([r.margin for r in rules])
    valid = (feat[:, None] != feat[None, :]) & np.triu(np.ones((len(rules), len(rules)), bool), 1)
    both_b, both_a = (S * behind) @ S.T, (S * ahead) @ S.T
    sb, sa = S @ behind, S @ ahead
    out = {
        "AND_behind": both_b, "AND_missed": ahead.sum() - both_a,
        "OR_behind": sb[:, None] + sb[None, :] - both_b, "OR_missed": ahead.sum() - (sa[:, None] + sa[None, :] - both_a),
        "margin": np.minimum(margin[:, None], margin[None, :]), "valid": valid,
    }  # fmt: skip
    return rules, S, out


def ranked_pairs(rules: list[Rule], S: np.ndarray, m: dict[str, np.ndarray], limit: int | None = None) -> list[tuple]:
    """Pairs sorted by (errors, behind on, −margin, order): (errors, behind, missed, margin, op, i, j)."""
    rows = []
    for op in ("AND", "OR"):
        errors = m[f"{op}_behind"] + m[f"{op}_missed"]
        ii, jj = np.nonzero(m["valid"])
        for i, j in zip(ii, jj):
            rows.append((int(round(errors[i, j])), int(round(m[f"{op}_behind"][i, j])),
                         int(round(m[f"{op}_missed"][i, j])), float(m["margin"][i, j]), op, int(i), int(j)))  # fmt: skip
    rows.sort(key=lambda r: (r[0], r[1], -round(r[3], 12), r[4], r[5], r[6]))
    return rows if limit is None else rows[:limit]


def pair_text(rules: list[Rule], op: str, i: int, j: int) -> str:
    return f"({rules[i].text()}) {op} ({rules[j].text()})"


def pair_on(rules: list[Rule], op: str, i: int, j: int, X: dict[str, np.ndarray]) -> np.ndarray:
    a, b = rules[i].on(X[rules[i].feature]), rules[j].on(X[rules[j].feature])
    return a & b if op == "AND" else a | b


def wrong(label: str, on: bool) -> bool:
    return (on and label == "behind") or (not on and label == "ahead")


def loo_single(cells: list[Cell], features: list[str]) -> list[dict[str, Any]]:
    out = []
    for k, held in enumerate(cells):
        rest = cells[:k] + cells[k + 1:]
        X = feature_matrix(rest, features)
        labels = np.array([c.label for c in rest])
        deltas = np.array([c.delta for c in rest])
        rules = single_rules(X, features)
        scored = sorted(((score(r.text(), r.on(X[r.feature]), labels, deltas, r.margin, i), r)
                         for i, r in enumerate(rules)), key=lambda sr: sr[0].key)  # fmt: skip
        best, rule = scored[0]
        ties = sum(1 for s, _ in scored if s.key[:2] == best.key[:2])
        call = bool(rule.on(np.array([held.feats[rule.feature]]))[0])
        out.append({"cell": held, "rule": rule.text(), "train_errors": best.errors, "ties": ties, "on": call,
                    "wrong": wrong(held.label, call)})  # fmt: skip
    return out


def loo_feature(cells: list[Cell], feature: str) -> int:
    """Held-out errors of the best threshold on one given feature."""
    errors = 0
    for k, held in enumerate(cells):
        rest = cells[:k] + cells[k + 1:]
        scored = best_single(rest, [feature])
        if not scored:
            continue
        rule = _rule_from_text(rest, feature, scored[0])
        errors += wrong(held.label, bool(rule.on(np.array([held.feats[feature]]))[0]))
    return errors


def _rule_from_text(cells: list[Cell], feature: str, s: Score) -> Rule:
    X = feature_matrix(cells, [feature])
    for r in single_rules(X, [feature]):
        if r.text() == s.text and r.margin == s.margin:
            return r
    raise RuntimeError("rule not found")


def loo_pairs(cells: list[Cell], features: list[str]) -> list[dict[str, Any]]:
    out = []
    for k, held in enumerate(cells):
        rest = cells[:k] + cells[k + 1:]
        rules, S, m = pair_scores(rest, features)
        top = ranked_pairs(rules, S, m, limit=None)
        errors, behind_on, _, _, op, i, j = top[0]
        ties = sum(1 for r in top if r[0] == errors and r[1] == behind_on)
        X = {f: np.array([held.feats[f]]) for f in features}
        call = bool(pair_on(rules, op, i, j, X)[0])
        out.append({"cell": held, "rule": pair_text(rules, op, i, j), "train_errors": errors, "ties": ties,
                    "on": call, "wrong": wrong(held.label, call)})  # fmt: skip
    return out


def validation_pick(cells: list[Cell]) -> Score | None:
    if any(math.isnan(c.val[0]) for c in cells):
        return None
    on = np.array([c.val[0] > c.val[1] for c in cells])
    return score("validation pick", on, np.array([c.label for c in cells]), np.array([c.delta for c in cells]), 0, 0)


def min_errors(S: np.ndarray, valid: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    """The fewest errors of any single rule (rows of S) and of any AND/OR pair, for ``labels``."""
    behind = (labels == "behind").astype(float)
    ahead = (labels == "ahead").astype(float)
    sb, sa = S @ behind, S @ ahead
    single = sb + ahead.sum() - sa
    both_b, both_a = (S * behind) @ S.T, (S * ahead) @ S.T
    and_err = both_b + ahead.sum() - both_a
    or_err = (sb[:, None] + sb[None, :] - both_b) + ahead.sum() - (sa[:, None] + sa[None, :] - both_a)
    pair = min(and_err[valid].min(), or_err[valid].min())
    return int(round(single.min())), int(round(pair))


def chance(cells: list[Cell], features: list[str], shuffles: int, seed: int = 0) -> tuple[int, int]:
    """In how many of ``shuffles`` label permutations a single rule / a pair fits with no error."""
    rules, S, m = pair_scores(cells, features)
    labels = np.array([c.label for c in cells])
    rng = np.random.default_rng(seed)
    zero1 = zero2 = 0
    for _ in range(shuffles):
        e1, e2 = min_errors(S, m["valid"], rng.permutation(labels))
        zero1 += e1 == 0
        zero2 += e2 == 0
    return zero1, zero2


def sensitivity(cells: list[Cell], features: list[str]) -> dict[str, Any]:
    """The search, leave-one-out and chance check on a subset of the cells."""
    singles = best_single(cells, features)
    rules, S, m = pair_scores(cells, features)
    pairs = ranked_pairs(rules, S, m)
    labels = [c.label for c in cells]
    c1, c2 = chance(cells, features, PERMUTATIONS)
    return {"n": len(cells), "single": singles[0], "zero_single": sum(s.errors == 0 for s in singles),
            "zero_pairs": sum(p[0] == 0 for p in pairs), "loo1": sum(r["wrong"] for r in loo_single(cells, features)),
            "loo2": sum(r["wrong"] for r in loo_pairs(cells, features)), "chance1": c1, "chance2": c2,
            "tally": f"{labels.count('ahead')} ahead, {labels.count('level')} level, {labels.count('behind')} behind"}  # fmt: skip


# --------------------------------------------------------------------------- report


def pm(d: float, se: float) -> str:
    return "—" if math.isnan(d) else f"{d:+.2f} ± {se:.2f}"


def cells_table(cells: list[Cell]) -> list[str]:
    out = ["| cell | source | seeds | b | σ_b | adaclip lr, C, μ | banded+ema lr, C, μ | Δ vs banded+ema (± SE) | "
           "label | Δ vs flat (± SE) | banded+ema − flat (± SE) |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in cells:
        fa, fb = c.ada.final[ADA], c.base.final[BASE]

        def hp(f: dict[str, Any]) -> str:
            return f"{f['hp']['lr']:g}, {f['hp']['max_grad_norm']:g}, {f['mu']}"

        out.append(f"| {c.name} | {c.source} | {c.n} | {fa['bands']} | {fa['sigma']:.3f} | {hp(fa)} | {hp(fb)} | "
                   f"{pm(c.delta, c.se)} | **{c.label}** | {pm(c.delta_flat, c.se_flat)} | {pm(*c.base_vs_flat)} |")  # fmt: skip
    return out


FEATURE_COLUMNS = ["eps", "d", "tensors", "bbar", "q", "N", "T", "Tq", "b", "bq", "sigma_1", "sigma_b", "v", "rho",
                   "kappa", "kappa_v", "snr", "noise_coord", "noise_coord_C", "drift_T"]  # fmt: skip


def features_table(cells: list[Cell]) -> list[str]:
    out = ["| cell | label | " + " | ".join(NAMES[f] for f in FEATURE_COLUMNS) + " |",
           "|---|---|" + "---|" * len(FEATURE_COLUMNS)]  # fmt: skip
    for c in cells:
        out.append(f"| {c.name} | {c.label} | " + " | ".join(fmt(c.feats[f]) for f in FEATURE_COLUMNS) + " |")
    return out


def names_of(cells: list[Cell], mask: np.ndarray) -> str:
    picked = [c.name for c, m in zip(cells, mask) if m]
    return ", ".join(picked) if picked else "none"


def build_report(tuned: list[Cell], fixed: list[Cell], counts: dict[str, int], command: str,
                 seconds_models: float, check_d: dict[str, tuple[int, int]] | None) -> str:  # fmt: skip
    features = [f for f, _ in SEARCHED]
    labels = np.array([c.label for c in tuned])
    deltas = np.array([c.delta for c in tuned])
    n_ahead, n_level, n_behind = (int(np.sum(labels == k)) for k in ("ahead", "level", "behind"))
    L: list[str] = ["# When is `AdaClip()` + banded + EMA ahead of banded + EMA? A rule on public quantities", ""]
    L += ["```", command, "```", ""]
    L += [f"Generated by `benchmarks/utility/adaclip_rule.py` from the recorded result files (no training). "
          f"Scanned {counts['files']} `round3_*.json` / `round4_*.json` files: {counts['cells']} (task, framework, "
          f"optimizer, ε) cells, {counts['cells_with_adaclip']} with `adaclip+banded+ema` runs; "
          f"{len(tuned)} cells with both methods under the tuned protocol (the rule's cells) and "
          f"{len(fixed)} records at a fixed lr and C (the main job's; a check only). How the files are picked, "
          "the features and the rule search are in the script's docstring.", ""]  # fmt: skip
    L += ["Labels: Δ = accuracy of `adaclip+banded+ema` − accuracy of `banded+ema` (flat clipping, the same noise "
          "plan, EMA), in points, paired by seed (3 seeds), SE = sd/√n; **ahead** if Δ > 2 SE, **behind** if "
          "Δ < −1 SE, else **level**. Δ vs flat is against tuned DP-SGD, for context (the issue's numbers).", ""]
    L += [f"Tally: {n_ahead} ahead, {n_level} level, {n_behind} behind (of {len(tuned)}).", ""]
    L += ["## Cells (tuned protocol: lr × C grid picked on validation for each method)", ""]
    L += cells_table(tuned)
    notes = [(c.name, n) for c in tuned for n in c.notes]
    if notes:
        L += [""] + [f"- {name}: {n}." for name, n in notes]
    L += ["", "## Public features of each cell", ""]
    L += [f"d from the task's model ({seconds_models:.1f} s to build the four models). σ_b, b, q, T from the "
          "`adaclip-banded` plan in the record; σ_1 from the `flat` plan; v = `BandedNoise(c).variance(T − 1)` (the "
          "mean over the run differs by < 0.1 %); ρ = `adaptive_lr_scale(c, T, σ_b, σ_1)`; κ = "
          f"`noise_drift_number(d, σ_b, B̄)` = {CLAMPED_NOISE_FRACTION:.3f}·d·σ_b²/B̄²; κ_v the same with σ_b·√v; "
          "drift over T = ½·T·ln(1 + (1 − β₂)(κ_v − 1)), β₂ = "
          f"{BETA_STD:g} (the default preset's). The σ_b·√v·C/B̄ column uses the C `adaclip+banded+ema` picked on "
          "validation: not public before tuning, so it is not searched.", ""]  # fmt: skip
    if check_d:
        L += ["d checked against the task loaders: " + ", ".join(f"{t} {a} = {b}" for t, (a, b) in check_d.items()), ""]
    L += features_table(tuned)

    # --- rule search on all cells
    singles = best_single(tuned, features)
    always = score("always on", np.ones(len(tuned), bool), labels, deltas, 0, -2)
    never = score("never on", np.zeros(len(tuned), bool), labels, deltas, 0, -1)
    L += ["", "## Rule search (all cells)", ""]
    L += ["Errors = behind cells turned on + ahead cells left off. Gain = Σ Δ over the cells the rule turns on "
          "(points summed over cells; 0 = banded + EMA everywhere).", ""]
    L += ["| rule | errors | behind turned on | ahead left off | level turned on | gain |", "|---|---|---|---|---|---|"]
    for s in (always, never):
        L.append(f"| {s.text} | {s.errors} | {names_of(tuned, s.on & (labels == 'behind'))} | "
                 f"{names_of(tuned, ~s.on & (labels == 'ahead'))} | {s.on_level} | {s.gain:+.1f} |")  # fmt: skip
    oracle = labels == "ahead"
    L.append(f"| oracle (on exactly where ahead) | 0 | none | none | 0 | {float(np.sum(deltas[oracle])):+.1f} |")
    L += ["", "**Best threshold on each single feature** (ties: the larger margin), with the leave-one-out errors "
          "of fitting a threshold on that feature alone:", ""]
    L += ["| feature | best rule | errors | behind turned on | ahead left off | level on | gain | margin | "
          "leave-one-out wrong |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    per_feature = []
    for f in features:
        fs = [s for s in singles if _feature_of_text(s.text, f)]
        if not fs:
            continue
        s = fs[0]
        per_feature.append((s.key, f, s))
    per_feature.sort(key=lambda t: t[0])
    loo_by_feature = {}
    for _, f, s in per_feature:
        loo_by_feature[f] = loo_feature(tuned, f)
        L.append(f"| {NAMES[f]} | {s.text} | {s.errors} | {names_of(tuned, s.on & (labels == 'behind'))} | "
                 f"{names_of(tuned, ~s.on & (labels == 'ahead'))} | {s.on_level} | {s.gain:+.1f} | "
                 f"{s.margin:.2f} | {loo_by_feature[f]} of {len(tuned)} |")  # fmt: skip
    zero_single = [s for s in singles if s.errors == 0]
    safe_single = [s for s in singles if s.on_behind == 0]
    best_safe = min(safe_single, key=lambda s: (s.ahead_missed, -s.margin, s.order)) if safe_single else None
    L += ["", f"Single-feature rules with no error: **{len(zero_single)}** of {len(singles)}."]
    if best_safe is not None:
        L.append(f"Best single-feature rule that turns no behind cell on: {best_safe.text} (leaves "
                 f"{best_safe.ahead_missed} of {n_ahead} ahead cells off: "
                 f"{names_of(tuned, ~best_safe.on & (labels == 'ahead'))}; gain {best_safe.gain:+.1f}).")  # fmt: skip

    rules, S, m = pair_scores(tuned, features)
    pairs = ranked_pairs(rules, S, m)
    zero_pairs = [p for p in pairs if p[0] == 0]
    X = feature_matrix(tuned, features)
    L += ["", f"**Pairs** (AND / OR of two single-feature rules on different features): {len(pairs):,} pairs, "
          f"**{len(zero_pairs):,}** with no error"
          + (f", over {len({frozenset((rules[p[5]].feature, rules[p[6]].feature)) for p in zero_pairs})} "
             "distinct feature pairs" if zero_pairs else "") + ". The ten with the largest margin:", ""]  # fmt: skip
    L += ["| rule | errors | behind turned on | ahead left off | level on | gain | margin |", "|---|---|---|---|---|---|---|"]
    for errors, _, _, margin, op, i, j in pairs[:10]:
        on = pair_on(rules, op, i, j, X)
        s = score(pair_text(rules, op, i, j), on, labels, deltas, margin, 0)
        L.append(f"| {s.text} | {errors} | {names_of(tuned, on & (labels == 'behind'))} | "
                 f"{names_of(tuned, ~on & (labels == 'ahead'))} | {s.on_level} | {s.gain:+.1f} | {margin:.2f} |")  # fmt: skip

    # --- leave-one-out
    loo1 = loo_single(tuned, features)
    loo2 = loo_pairs(tuned, features)
    L += ["", "## Leave-one-out", ""]
    L += ["For each cell: the top-ranked rule fitted on the other cells (single feature; then pairs), applied to "
          "the held-out cell. *ties* = how many rules share the fitted rule's (errors, behind-on) on the other "
          "cells — the margin picks among them.", ""]
    L += ["| held-out cell | label | single: rule fitted on the rest (errors there, ties) | on? | wrong? | "
          "pair: rule fitted on the rest (errors there, ties) | on? | wrong? |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for a, b in zip(loo1, loo2):
        c = a["cell"]
        L.append(f"| {c.name} | {c.label} | {a['rule']} ({a['train_errors']}, {a['ties']}) | "
                 f"{'on' if a['on'] else 'off'} | {'**wrong**' if a['wrong'] else 'ok'} | {b['rule']} "
                 f"({b['train_errors']}, {b['ties']:,}) | {'on' if b['on'] else 'off'} | "
                 f"{'**wrong**' if b['wrong'] else 'ok'} |")  # fmt: skip
    w1, w2 = sum(r["wrong"] for r in loo1), sum(r["wrong"] for r in loo2)
    L += ["", f"Held-out cells wrong: single-feature procedure **{w1} of {len(tuned)}**, pair procedure "
          f"**{w2} of {len(tuned)}** (a level cell cannot be wrong; {n_level} of the {len(tuned)} are level, so "
          f"at most {n_ahead + n_behind} can be).", ""]  # fmt: skip

    # --- fixed-hyperparameter check
    top_single = singles[0]
    top_rule = _rule_from_text(tuned, _feature_in(top_single.text, features), top_single)
    e0, _, _, mg, op0, i0, j0 = pairs[0]
    if fixed:
        L += ["## Check: the main job's records (fixed lr = 0.2, C = 1; not used in the search)", ""]
        L += [f"The top single rule on all cells ({top_single.text}) and the top pair "
              f"({pair_text(rules, op0, i0, j0)}), applied to these records' own public features.", ""]  # fmt: skip
        L += ["| record | accountant | b | σ_b | Δ vs banded+ema (± SE) | label | Δ vs flat | single rule | "
              "pair rule |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in fixed:
            Xc = {f: np.array([c.feats[f]]) for f in features}
            s_on = bool(top_rule.on(Xc[top_rule.feature])[0])
            p_on = bool(pair_on(rules, op0, i0, j0, Xc)[0])
            fa = c.ada.final[ADA]
            L.append(f"| {c.name} `{c.ada.path.name}` | {c.accountant} | {fa['bands']} | {fa['sigma']:.3f} | "
                     f"{pm(c.delta, c.se)} | {c.label} | {pm(c.delta_flat, c.se_flat)} | "
                     f"{'on' if s_on else 'off'}{' (wrong)' if wrong(c.label, s_on) else ''} | "
                     f"{'on' if p_on else 'off'}{' (wrong)' if wrong(c.label, p_on) else ''} |")  # fmt: skip
        L.append("")

    # --- not public: the choice on validation
    vp = validation_pick(tuned)
    if vp is not None:
        L += ["## For comparison, not public: AdaCliP on where its validation winner beats banded + EMA's", ""]
        L += ["Each method's lr × C (and μ) winner has a validation mean (training split minus 20 %, the tuning "
              "seed); turning AdaCliP on where its winner's is higher needs both grids run (twice the tuning "
              "budget), so it is not a rule on public quantities; it is what a practitioner who tunes both can do.", ""]
        L += ["| cell | label | val. adaclip+banded+ema | val. banded+ema | picked |", "|---|---|---|---|---|"]
        for c in tuned:
            L.append(f"| {c.name} | {c.label} | {100 * c.val[0]:.2f} | {100 * c.val[1]:.2f} | "
                     f"{'adaclip' if c.val[0] > c.val[1] else 'banded+ema'}"
                     f"{' (wrong)' if wrong(c.label, c.val[0] > c.val[1]) else ''} |")  # fmt: skip
        L += ["", f"Validation pick: {vp.on_behind} behind cell(s) turned on, {vp.ahead_missed} ahead cell(s) left off "
              f"({names_of(tuned, ~vp.on & (labels == 'ahead'))}), gain {vp.gain:+.1f} (oracle "
              f"{float(np.sum(deltas[labels == 'ahead'])):+.1f}).", ""]  # fmt: skip

    # --- chance and sensitivity
    chance1, chance2 = chance(tuned, features, PERMUTATIONS)
    L += ["## Chance check", ""]
    L += [f"The same search with the {len(tuned)} labels shuffled among the cells ({PERMUTATIONS} shuffles, "
          f"NumPy seed 0; the tally {n_ahead}/{n_level}/{n_behind} kept): a single-feature rule with no error exists "
          f"in **{chance1} of {PERMUTATIONS}** shuffles, a pair with no error in **{chance2} of {PERMUTATIONS}**. "
          "A perfect fit is worth something only if it is rare under shuffled labels.", ""]  # fmt: skip
    banded_only = [c for c in tuned if c.feats["b"] > 1]
    sens = None
    if len(banded_only) < len(tuned) and len(banded_only) >= 4:
        sens = sensitivity(banded_only, features)
        L += ["## Sensitivity: without the b = 1 cells", ""]
        L += [f"The library's rule chose b = 1 (independent noise) in {len(tuned) - len(banded_only)} cell(s) "
              f"({', '.join(c.name for c in tuned if c.feats['b'] == 1)}); on the other {len(banded_only)} cells "
              f"({sens['tally']}): best single rule *{sens['single'].text}*, {sens['single'].errors} error(s); "
              f"{sens['zero_single']} single and {sens['zero_pairs']:,} pair rules with no error; leave-one-out "
              f"wrong: single {sens['loo1']} of {len(banded_only)}, pair {sens['loo2']} of {len(banded_only)}; "
              f"chance check: a perfect single rule in {sens['chance1']} and a perfect pair in {sens['chance2']} of "
              f"{PERMUTATIONS} shuffles.", ""]  # fmt: skip

    # --- reading
    L += ["## Reading", ""]
    L += reading(tuned, singles, best_safe, pairs, zero_pairs, rules, loo1, loo2, loo_by_feature,
                 (chance1, chance2), sens)  # fmt: skip
    return "\n".join(L) + "\n"


def _feature_of_text(text: str, feature: str) -> bool:
    if feature == "adam":
        return text in ("optimizer is Adam", "optimizer is SGD")
    return text.startswith(NAMES[feature] + " >") or text.startswith(NAMES[feature] + " ≤")


def _feature_in(text: str, features: list[str]) -> str:
    for f in features:
        if _feature_of_text(text, f):
            return f
    raise KeyError(text)


def _span(values: Any) -> str:
    v = sorted(set(values))
    return f"{v[0]}" if len(v) == 1 else f"{v[0]}–{v[-1]}"


def neighbours(cells: list[Cell], feature: str, threshold: float) -> str:
    """The cells just below and just above a threshold on one feature."""
    below = [c for c in cells if c.feats[feature] <= threshold]
    above = [c for c in cells if c.feats[feature] > threshold]
    lo = max(below, key=lambda c: c.feats[feature]) if below else None
    hi = min(above, key=lambda c: c.feats[feature]) if above else None
    part = [f"{c.name} ({c.label}) at {fmt(c.feats[feature])}" for c in (lo, hi) if c is not None]
    return " and ".join(part)


def flips(cells: list[Cell]) -> tuple[list[str], list[str]]:
    """Where the label changes with the optimizer alone (same task and ε), and with ε alone."""
    by_opt: dict[tuple, list[Cell]] = {}
    by_eps: dict[tuple, list[Cell]] = {}
    for c in cells:
        by_opt.setdefault((c.task, c.eps), []).append(c)
        by_eps.setdefault((c.task, c.optimizer), []).append(c)

    def show(c: Cell, what: str) -> str:
        return f"{what} {c.label} (b = {c.feats['b']:g}, σ_b = {c.feats['sigma_b']:.2f}, κ_v = {c.feats['kappa_v']:.2f})"

    opt_flips = [f"{t} ε = {e:g}: " + ", ".join(show(c, c.name.split()[1]) for c in cs)
                 for (t, e), cs in by_opt.items() if {"ahead", "behind"} <= {c.label for c in cs}]  # fmt: skip
    eps_flips = [f"{t} {cs[0].name.split()[1]}: " + ", ".join(show(c, f"ε = {c.eps:g}") for c in sorted(cs, key=lambda c: c.eps))
                 for (t, o), cs in by_eps.items() if {"ahead", "behind"} <= {c.label for c in cs}]  # fmt: skip
    return opt_flips, eps_flips


def reading(tuned, singles, best_safe, pairs, zero_pairs, rules, loo1, loo2, loo_by_feature, chances,
            sens) -> list[str]:  # fmt: skip
    n = len(tuned)
    labels = [c.label for c in tuned]
    n_ahead, n_level, n_behind = (labels.count(k) for k in ("ahead", "level", "behind"))
    w1, w2 = sum(r["wrong"] for r in loo1), sum(r["wrong"] for r in loo2)
    zero_single = [s for s in singles if s.errors == 0]
    out = []
    ahead_names = ", ".join(c.name for c in tuned if c.label == "ahead")
    behind_names = ", ".join(c.name for c in tuned if c.label == "behind")
    out.append(f"- **Cells.** {n} cells have both methods under the tuned protocol: {n_ahead} ahead ({ahead_names}); "
               f"{n_level} level; {n_behind} behind ({behind_names}). {len({c.task for c in tuned})} tasks, "
               f"{len({c.optimizer for c in tuned})} optimizers, ε ∈ {{{', '.join(f'{e:g}' for e in sorted({c.eps for c in tuned}))}}}; "
               f"{_span(c.n for c in tuned)} seeds a cell.")  # fmt: skip
    top = singles[0]
    f_top = _feature_in(top.text, [f for f, _ in SEARCHED])
    thr = _rule_from_text(tuned, f_top, top).threshold
    if zero_single:
        out.append(f"- **One feature.** {len(zero_single)} single-feature rule(s) fit every cell; the widest-margin "
                   f"one is *{top.text}* (margin {top.margin:.2f}; the nearest cells: {neighbours(tuned, f_top, thr)}).")  # fmt: skip
    else:
        out.append(f"- **One feature: none fits.** The best single threshold, *{top.text}*, makes {top.errors} "
                   f"error(s) ({top.on_behind} behind cell(s) on, {top.ahead_missed} ahead cell(s) off: "
                   f"{names_of(tuned, ~top.on & (np.array(labels) == 'ahead'))}); it sits in a gap of {top.margin:.2f} "
                   f"of σ_b's log range, between {neighbours(tuned, f_top, thr)}. The library's drift number does not "
                   f"separate the cells: best κ rule {_best_errors(singles, 'kappa')} errors, best κ_v rule "
                   f"{_best_errors(singles, 'kappa_v')}.")  # fmt: skip
        ka = [c.feats["kappa"] for c in tuned if c.label == "ahead"]
        kb = [c.feats["kappa"] for c in tuned if c.label == "behind"]
        if ka and kb:
            out.append(f"  κ spans {fmt(min(ka))}–{fmt(max(ka))} in the ahead cells and {fmt(min(kb))}–{fmt(max(kb))} "
                       "in the behind cells.")  # fmt: skip
    if zero_pairs:
        e, _, _, mg, op, i, j = pairs[0]
        out.append(f"- **Two features.** {len(zero_pairs):,} of {len(pairs):,} AND/OR pairs fit all {n} cells (widest "
                   f"margin: *{pair_text(rules, op, i, j)}*, margin {mg:.2f}). Under shuffled labels a perfect pair "
                   f"exists in {chances[1]} of {PERMUTATIONS} shuffles ({100 * chances[1] / PERMUTATIONS:.1f} %; a "
                   f"perfect single rule in {chances[0]}), so "
                   + ("finding one is within what chance alone gives." if chances[1] >= PERMUTATIONS // 20 else
                      "finding one is rarer than chance alone gives, but see leave-one-out.") )  # fmt: skip
    else:
        e, _, _, mg, op, i, j = pairs[0]
        out.append(f"- **Two features.** No pair fits every cell; the best, *{pair_text(rules, op, i, j)}*, makes {e} "
                   "error(s).")
    fewest = min(loo_by_feature.values())
    steadiest = ", ".join(NAMES[f] for f, _ in SEARCHED if loo_by_feature.get(f) == fewest)
    out.append(f"- **Leave-one-out.** Fitted on {n - 1} cells and applied to the held-out one, the single-feature "
               f"procedure is wrong on {w1} of {n} cells ({', '.join(r['cell'].name for r in loo1 if r['wrong']) or 'none'}) "
               f"and the pair procedure on {w2} of {n} ({', '.join(r['cell'].name for r in loo2 if r['wrong']) or 'none'}); "
               f"at most {n_ahead + n_behind} can be wrong (level cells never count). The steadiest single features "
               f"({steadiest}), each refitted alone, are wrong on {fewest}.")  # fmt: skip
    opt_flips, eps_flips = flips(tuned)
    if opt_flips or eps_flips:
        out.append("- **Where the label flips.** " + (
            "With the optimizer alone (same task and ε): " + "; ".join(opt_flips) + ". " if opt_flips else "")
            + ("With ε alone (same task and optimizer): " + "; ".join(eps_flips) + "." if eps_flips else ""))  # fmt: skip
    holds = bool(zero_single) and w1 == 0
    if holds:
        out.append(f"- **Verdict.** A single-feature rule (*{top.text}*) fits every cell and survives leave-one-out; it "
                   f"rests on {n} cells from {len({c.task for c in tuned})} tasks.")  # fmt: skip
    else:
        out.append("- **Verdict: no rule holds up.** " + (
            "No threshold on one public feature meets the target (never behind banded + EMA by more than 1 SE, and "
            "on wherever AdaCliP was ahead) even on the cells it is fitted to. " if not zero_single else
            "A single-feature rule fits all cells but fails leave-one-out. ")
            + (f"Two-feature rules can be fitted to the {n} cells, but they are picked from {len(pairs):,} candidates "
               f"on the cells they are judged on, and refitted without a cell they get {w2} of {n} held-out cells "
               "wrong. " if zero_pairs else "")
            + ("The safest single rule found, *" + best_safe.text + f"*, never turns a behind cell on here but leaves "
               f"{best_safe.ahead_missed} of {n_ahead} ahead cells off and misses under leave-one-out "
               f"({loo_by_feature[_feature_in(best_safe.text, [f for f, _ in SEARCHED])]} of {n}); it is a description "
               "of these cells, not a rule to ship." if best_safe is not None else ""))  # fmt: skip
    vp = validation_pick(tuned)
    if vp is not None:
        out.append(f"- **What does work, at a price.** Choosing on validation between the two tuned winners (not "
                   f"public: it needs both grids) turns {vp.on_behind} behind cell(s) on and leaves {vp.ahead_missed} "
                   f"ahead cell(s) off ({names_of(tuned, ~vp.on & (np.array(labels) == 'ahead'))}), better than any "
                   "public single-feature rule here.")  # fmt: skip
    if sens is not None:
        out.append(f"- **Without the b = 1 cells** ({sens['n']} cells): best single rule {sens['single'].errors} "
                   f"error(s), leave-one-out wrong {sens['loo1']} (single) and {sens['loo2']} (pair); the conclusion "
                   + ("does not change." if (sens["single"].errors > 0 or sens["loo1"] > 0) == (not holds) else "changes.") )  # fmt: skip
    adam_bad = [c for c in tuned if c.optimizer == "adam" and label_of(*c.base_vs_flat) == "behind"]
    b1 = [c.name for c in tuned if c.feats["b"] == 1]
    merged = [c.name for c in tuned if c.ada.path != c.base.path]
    out.append(
        f"- **Caveats.** {n} cells from {len({c.task for c in tuned})} tasks, 3 seeds each (an SE rests on 2 degrees of "
        "freedom); every rule here is chosen on the cells it is judged on, and leave-one-out, the only out-of-sample "
        "check, still holds out cells of tasks that stay in the fit. The comparison is with banded + EMA at its own "
        "tuned lr and C (the lr × C grid is round two's, picked on validation for each method), not with the "
        "library's recommended Adam configuration (learning rate × ρ, uncapped b)"
        + (f"; banded + EMA is itself behind flat by more than 1 SE in {len(adam_bad)} Adam cell(s) "
           f"({', '.join(f'{c.name} {c.base_vs_flat[0]:+.1f}' for c in adam_bad)}), so 'ahead of banded + EMA' there "
           "is not 'ahead of DP-SGD'" if adam_bad else "")
        + f". κ's drift law is derived for the patent's coupled scale; `AdaClip()`'s default builds scale "
        f"'{DEFAULT_STRATEGY.scale}', pooling '{DEFAULT_STRATEGY.pooling}', correction '{DEFAULT_STRATEGY.correction}', "
        f"for which `noise_drift_applies()` is {DEFAULT_STRATEGY.noise_drift_applies()}, so κ is used here only as a "
        "public noise-level number"
        + (f". In {len(b1)} cell(s) ({', '.join(b1)}) the library's b is 1, so 'banded' there is independent noise" if b1 else "")
        + (f". {len(merged)} cell(s) ({', '.join(merged)}) pair runs from two recordings of the same protocol (see the "
           "notes under the first table)" if merged else "") + ".")  # fmt: skip
    return out


def _best_errors(singles: list[Score], feature: str) -> str:
    fs = [s for s in singles if _feature_of_text(s.text, feature)]
    return str(fs[0].errors) if fs else "—"


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the Markdown report here (default: print it)")
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of the round3_/round4_ JSONs")
    p.add_argument("--check-d", action="store_true", help="also count d with the task loaders (slow: ~45 s)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    paths = sorted(args.results.glob("round3_*.json")) + sorted(args.results.glob("round4_*.json"))
    tuned, fixed, counts = select_cells(load_records(paths))
    t1 = time.perf_counter()
    sizes = {t: model_sizes(t) for t in sorted({c.task for c in tuned + fixed})}
    seconds_models = time.perf_counter() - t1
    check = {t: (sizes[t]["d"], model_sizes_loaded(t)) for t in sizes} if args.check_d else None
    for c in tuned + fixed:
        measure(c, sizes[c.task])
    order = {"digits-mlp": 0, "mnist1d-long": 1, "lstm-users-long": 2, "transformer-lm-long": 3}
    tuned.sort(key=lambda c: (order.get(c.task, 9), c.task, c.optimizer, c.eps))
    fixed.sort(key=lambda c: (c.task, c.optimizer, c.eps, c.accountant))
    command = "python benchmarks/utility/adaclip_rule.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    text = build_report(tuned, fixed, counts, command, seconds_models, check)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out} ({time.perf_counter() - t0:.1f} s)")
    return text


if __name__ == "__main__":
    main()
