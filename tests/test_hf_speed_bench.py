"""Smoke test of the Hugging Face speed benchmark (benchmarks/hf_speed.py) against Opacus.

``--quick`` runs every (model × mode × method) cell on tiny configs (1 layer, hidden 32, batch 4,
1 round) with the σ = 0 equivalence check: each library's clipped update must match our
materialised flat clipping, which is what makes the timings comparable.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("opacus")

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "hf_speed.py"
OURS = [f"{k}_{p}" for k in ("flat", "adaclip") for p in ("materialise", "ghost", "auto")]


def hf_methods() -> list[str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_speed_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return list(mod.METHODS)


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=True,
    )


def test_quick_runs_every_cell_and_the_libraries_clip_alike(tmp_path):
    out = tmp_path / "quick.json"
    proc = run("--quick", "--json", str(out))
    record = json.loads(out.read_text())
    cells = {(c["model"], c["mode"]): c for c in record["cells"]}
    assert set(cells) == {(m, md) for m in ("gpt2", "bert") for md in ("lora", "full")}
    for (model, mode), c in cells.items():
        # non-private and every path of ours run on every model and mode
        for m in ["nonprivate", *OURS]:
            assert m in c["times_s"], (model, mode, m, c["errors"].get(m))
            assert len(c["times_s"][m]) == 1 and c["times_s"][m][0] > 0
        # every method is either timed (wall clock and CPU) or has a recorded error
        expected = set(hf_methods()) - (set() if mode == "full" else {"opacus_hooks+ids", "opacus_ghost+ids"})
        assert set(c["times_s"]).isdisjoint(c["errors"])
        assert set(c["times_s"]) | set(c["errors"]) == expected
        assert set(c["cpu_s"]) == set(c["times_s"])
        # the σ = 0 update of every working clipping method equals our materialised flat one
        check = c["check"]
        assert check["clip"] > 0
        for m, v in check.items():
            if m == "clip" or isinstance(v, str):
                continue
            assert v < 1e-3, (model, mode, m, v)
        assert isinstance(check["flat_ghost"], float) and isinstance(check["flat_auto"], float)
    # Opacus runs LoRA on both models and agrees with us there
    for model in ("gpt2", "bert"):
        c = cells[(model, "lora")]
        assert {"opacus_hooks", "opacus_ghost"} <= set(c["times_s"]), c["errors"]
        assert c["check"]["opacus_ghost"] < 1e-3 and c["check"]["opacus_hooks"] < 1e-3
    # full fine-tuning: Opacus fails on the models' (1, L) position ids and, with ghost
    # clipping, on GPT-2's tied embedding even with batched ids; the failures are recorded
    full_gpt2 = cells[("gpt2", "full")]
    assert "Parameter tying" in full_gpt2["errors"]["opacus_ghost+ids"]["error"]
    assert "opacus_hooks+ids" in full_gpt2["times_s"]
    assert "opacus_hooks" in full_gpt2["errors"]
    assert "opacus_ghost+ids" in cells[("bert", "full")]["times_s"]
    # the report: the timing table, what works, the errors
    assert "What works" in proc.stdout and "| gpt2 | full |" in proc.stdout
    assert "Parameter tying is not supported" in proc.stdout


def test_memory_probe_reports_a_peak():
    sizes = json.dumps({"layers": 1, "hidden": 32, "heads": 2, "vocab": 100, "seq": 16})
    proc = run("--memory-probe", "gpt2", "full", "4", "flat_auto", "--sizes", sizes)
    peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]
    assert peak >= 0


@pytest.mark.slow
def test_one_full_size_cell(tmp_path):
    """One real cell (GPT-2 4×256, LoRA, batch 32, 2 rounds) with the memory probes."""
    out = tmp_path / "cell.json"
    run("--models", "gpt2", "--modes", "lora", "--batches", "32", "--rounds", "2",
        "--methods", "nonprivate,flat_auto,opacus_ghost", "--memory-jobs", "1", "--json", str(out),
        timeout=900)  # fmt: skip
    (c,) = json.loads(out.read_text())["cells"]
    assert set(c["times_s"]) == {"nonprivate", "flat_auto", "opacus_ghost"}
    assert all(len(v) == 2 for v in c["times_s"].values())
    assert all(v is not None and v > 0 for v in c["peak_mib"].values())
