"""The FSDP2 + banded-noise benchmark's smoke run (``benchmarks/fsdp_gpt2_bands.py --quick``).

Two CPU processes on gloo, a tiny GPT-2 sharded with FSDP2 and ``FlatClip(distributed=True)``,
once with independent noise and once with banded noise (b = 3) whose state is sharded over the
ranks: the report has a row per configuration and rank, and each rank's noise buffers are
``(b − 1)·⌈d/R⌉`` float32 numbers (d is even here, so both ranks' slices are ⌈d/R⌉ long), none
with independent noise. Runs the script as a subprocess, as a user would (about 60 s on 2 cores:
two spawns of two processes that each import torch and transformers).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]
pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fsdp_gpt2_bands.py"
RANKS, BANDS, STEPS = 2, 3, 2


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    stem = tmp_path_factory.mktemp("fsdp_gpt2_bands") / "quick"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--ranks", str(RANKS), "--bands", str(BANDS),
           "--steps", str(STEPS), "--out", str(stem)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(Path(f"{stem}.json").read_text()), Path(f"{stem}.md").read_text()


def test_report_has_a_row_per_configuration_and_rank(report):
    data, md = report
    assert [res["config"] for res in data["results"]] == ["independent", "banded"]
    for rank in range(RANKS):  # per rank, resident set, CPU time; and banded against independent
        assert md.count(f"| independent | {rank} |") == 3
        assert md.count(f"| banded | {rank} |") == 4
    assert data["command"].startswith("python benchmarks/fsdp_gpt2_bands.py --quick")
    assert data["machine"]["cores"] and data["machine"]["torch"] and data["machine"]["transformers"]
    for res in data["results"]:
        assert [r["rank"] for r in res["ranks"]] == list(range(RANKS))
        for r in res["ranks"]:
            assert len(r["step_times_s"]) == STEPS and all(t > 0 for t in r["step_times_s"])
            assert r["peak_timed_mib"] >= r["rss_before_timed_mib"] > 0


def test_banded_buffers_are_sharded_over_the_ranks(report):
    data, md = report
    by = {res["config"]: res["ranks"] for res in data["results"]}
    d = by["banded"][0]["d"]
    assert d % RANKS == 0  # every rank's slice is ⌈d/R⌉ long
    per_rank = (BANDS - 1) * -(-d // RANKS) * 4
    for rank, r in enumerate(by["banded"]):
        assert r["noise_sharding"] == "sharded"
        assert r["steps_taken"] >= BANDS - 1 and r["noise_buffers"] == BANDS - 1
        assert r["noise_buffer_dtype"] == "torch.float32"
        assert r["noise_buffer_bytes"] == per_rank
        assert r["noise_shard"][2:] == [rank * d // RANKS, (rank + 1) * d // RANKS, d]
    for r in by["independent"]:
        assert r["noise_buffer_bytes"] == 0 and r["noise_buffers"] == 0
    assert all(line.endswith(": ok") for line in data["checks"]) and len(data["checks"]) == 2 * RANKS
    assert "MISMATCH" not in md
