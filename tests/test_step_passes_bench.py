"""``benchmarks/step_passes.py``: the sweeps over the MLP's first weight in one whole step.

The end-to-end form of the per-tensor test in ``test_core_per_tensor_statistics.py``: through
``AdaClip()``'s default on the ghost path (hooks, ghost norms, clipped sum, noise, release,
statistics, SGD), the step sweeps the weight at most 5 times more than flat clipping (the
centre's terms). Before its statistics were kept as one number per tensor it was 36 against 8.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_passes.py"


def _module():
    spec = importlib.util.spec_from_file_location("step_passes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_step_sweeps_the_weight_at_most_five_times_more_than_flat_clipping():
    passes = _module()
    flat = passes.count("flat_ghost")
    default = passes.count("adaclip_ghost")
    assert len(passes.count("nonprivate")) == 2  # the counter sees the backward's product and SGD's update
    assert len(flat) == 8, flat
    assert len(default) <= len(flat) + 5, default
    # the patent's per-coordinate statistics do sweep it for each operation (the counter can tell)
    assert len(passes.count("patent_ghost")) >= 25
