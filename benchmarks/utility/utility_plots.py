"""PNG plots of one utility-benchmark result (the JSON written by ``run.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

COLORS = {"flat": "tab:blue", "per_layer": "tab:orange", "scaled": "tab:green", "adaclip": "tab:red",
          "nonprivate": "black"}


def plot_all(out: dict[str, Any], folder: Path, stem: str) -> list[Path]:
    return [plot_vs_epsilon(out, folder, stem), plot_curves(out, folder, stem), plot_trace(out, folder, stem)]


def plot_vs_epsilon(out, folder, stem) -> Path:
    fig, ax = plt.subplots(figsize=(5, 3.6))
    eps = out["epsilons"]
    for m in ("flat", "per_layer", "scaled", "adaclip"):
        keys = [f"{m}@{e}" for e in eps]
        if not all(k in out["final"] for k in keys):
            continue
        mu = [out["final"][k]["test"]["mean"] for k in keys]
        sd = [out["final"][k]["test"]["std"] for k in keys]
        ax.errorbar(eps, mu, yerr=sd, marker="o", capsize=3, label=m, color=COLORS[m])
    if "nonprivate" in out["final"]:
        ax.axhline(out["final"]["nonprivate"]["test"]["mean"], color="black", ls="--", label="non-private")
    ax.set_xscale("log")
    ax.set_xticks(eps, [f"{e:g}" for e in eps])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(f"ε (δ = {out['delta']:g})")
    ax.set_ylabel(f"test {out['metric']}")
    ax.set_title(f"{out['task']} ({out['framework']}{', quick' if out['quick'] else ''})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = folder / f"{stem}_vs_epsilon.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(out, folder, stem) -> Path:
    eps = out["epsilons"]
    fig, axes = plt.subplots(1, len(eps), figsize=(4 * len(eps), 3.4), squeeze=False)
    for ax, e in zip(axes[0], eps):
        for m in ("nonprivate", "flat", "per_layer", "scaled", "adaclip"):
            key = m if m == "nonprivate" else f"{m}@{e}"
            if key not in out["final"] or not out["final"][key]["runs"][0]["curve"]:
                continue
            runs = out["final"][key]["runs"]
            ep = [c["epoch"] for c in runs[0]["curve"]]
            vals = np.array([[c["metric"] for c in r["curve"]] for r in runs])
            ax.plot(ep, vals.mean(0), label=m, color=COLORS[m], ls="--" if m == "nonprivate" else "-")
            if len(runs) > 1:
                ax.fill_between(ep, vals.min(0), vals.max(0), color=COLORS[m], alpha=0.15)
        ax.set_title(f"ε = {e:g}")
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"test {out['metric']}")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{out['task']}: training curves (mean over seeds, band = min–max)")
    fig.tight_layout()
    path = folder / f"{stem}_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_trace(out, folder, stem) -> Path:
    eps = out["epsilons"]
    fig, axes = plt.subplots(2, len(eps), figsize=(4 * len(eps), 6), squeeze=False)
    for j, e in enumerate(eps):
        key = f"adaclip@{e}"
        if key not in out["final"]:
            continue
        trace = out["final"][key]["runs"][0]["trace"]
        if not trace:
            continue
        steps = [t["step"] for t in trace]
        for row, what in enumerate(("b", "std")):
            arr = np.array([t[what] for t in trace])
            for k in range(arr.shape[1]):
                axes[row][j].plot(steps, arr[:, k], label=f"tensor {k}")
            axes[row][j].set_yscale("log")
            axes[row][j].set_xlabel("step")
            axes[row][j].set_ylabel(f"mean {what} over the tensor")
            axes[row][j].set_title(f"AdaCliP {what}, ε = {e:g} (seed 0)")
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=7)
    else:
        axes[0][0].text(0.5, 0.5, "no AdaCliP state recorded\n(JAX runs do not trace it)", ha="center",
                        transform=axes[0][0].transAxes)
    fig.tight_layout()
    path = folder / f"{stem}_adaclip_state.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
