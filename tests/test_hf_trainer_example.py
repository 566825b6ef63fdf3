"""The Trainer example (``examples/hf_trainer.py``) end to end, in quick mode: it builds banded
noise with an EMA of the parameters through ``PrivateTrainer``, spends at most the target ε, and
the averaged model's held-out loss on the private corpus drops below the pretrained model's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"


def test_the_quick_trainer_example_trains_privately_with_banded_noise_and_an_average(tmp_path) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--quick", "--epochs", "2", "--save", str(tmp_path)],
                         capture_output=True, text=True, check=True, timeout=600).stdout  # fmt: skip
    built = re.search(r"^built: banded noise, b = (\d+), sigma = ([0-9.]+)", out, re.M)
    assert built and int(built[1]) > 1, out
    before = float(re.search(r"^before: held-out loss ([0-9.]+)", out, re.M)[1])
    after = float(re.search(r"^after:  held-out loss ([0-9.]+) .*\(averaged model\)", out, re.M)[1])
    epsilon = float(re.search(r"^epsilon = ([0-9.]+) \(delta = 1e-05, target 8\)", out, re.M)[1])
    assert after < before - 0.01 and 7.0 < epsilon <= 8.0, out
    assert "'loss'" not in out and "grad_norm" not in out  # the Trainer's logs carry no training loss
    assert (tmp_path / "model.safetensors").exists()  # save_model wrote the averaged model
