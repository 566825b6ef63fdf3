"""Importing adaclip and its framework packages does not load SciPy or dp-accounting.

SciPy (which dp-accounting imports too) costs a second or more at import, and only calibration,
privacy accounting and the fitting of correlated-noise coefficients need it, so those import it
when first called. Each case runs in a fresh interpreter (this process has long loaded both);
times are not asserted (too noisy on a shared machine): ``benchmarks/results/import_time.md``
records them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What ``import adaclip…`` must leave unloaded: the heavy dependencies, and our module that
#: subclasses a dp-accounting class (imported only by the code that composes PLDs).
LAZY = ("scipy", "dp_accounting", "adaclip.accounting._gaussian_pld")


def _run(code: str) -> dict:
    """Run ``code`` in a fresh interpreter at the repository root; it prints one JSON object."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _needs(package: str | None) -> list:
    if package is None or importlib.util.find_spec(package) is not None:
        return []
    return [pytest.mark.skip(reason=f"needs {package}")]


@pytest.mark.parametrize(
    "module",
    [
        pytest.param("adaclip", id="adaclip"),
        pytest.param("adaclip.accounting", id="adaclip.accounting"),
        pytest.param("adaclip.correlated", id="adaclip.correlated"),
        pytest.param("adaclip_torch", id="adaclip_torch", marks=_needs("torch")),
        pytest.param("adaclip_jax", id="adaclip_jax", marks=_needs("optax")),
    ],
)
def test_import_leaves_heavy_dependencies_unloaded(module):
    code = (
        "import importlib, json, sys\n"
        f"m = importlib.import_module({module!r})\n"
        f"lazy = {LAZY!r}\n"
        "after_import = [name for name in lazy if name in sys.modules]\n"
        # every public name still resolves, without loading them either
        "missing = [name for name in getattr(m, '__all__', ()) if not hasattr(m, name)]\n"
        "after_all = [name for name in lazy if name in sys.modules]\n"
        "print(json.dumps({'after_import': after_import, 'missing': missing, 'after_all': after_all}))\n"
    )
    result = _run(code)
    assert result == {"after_import": [], "missing": [], "after_all": []}


def test_lazy_paths_load_dependencies_and_give_the_same_results():
    """The first calibration, accountant query and coefficient fit load dp-accounting and SciPy
    themselves, and give bit-for-bit what this process (where both are loaded) computes."""
    code = (
        "import json, logging, sys\n"
        "from adaclip.accounting import Accountant, calibrate_noise_multiplier\n"
        "from adaclip.correlated.coefficients import optimise_banded_coefficients\n"
        "before = [name for name in ('scipy', 'dp_accounting') if name in sys.modules]\n"
        "sigma = calibrate_noise_multiplier(target_epsilon=2.0, delta=1e-5, sample_rate=0.01, steps=200)\n"
        "after_calibration = [name for name in ('scipy', 'dp_accounting') if name in sys.modules]\n"
        "acc = Accountant('rdp')\n"
        "acc.step(noise_multiplier=1.1, sample_rate=256 / 60000, num_steps=14062)\n"
        "coefficients = optimise_banded_coefficients(4, 300).tolist()\n"
        "from adaclip.accounting import _RELATION\n"
        "print(json.dumps({'before': before, 'after_calibration': after_calibration, 'sigma': sigma,\n"
        "                  'epsilon': acc.epsilon(1e-5), 'coefficients': coefficients, 'relation': str(_RELATION),\n"
        "                  'absl_logger': type(logging.getLogger('absl')).__name__}))\n"
    )
    result = _run(code)
    assert result["before"] == []
    assert result["after_calibration"] == ["scipy", "dp_accounting"]

    import absl.logging
    from dp_accounting.privacy_accountant import NeighboringRelation

    from adaclip.accounting import Accountant, calibrate_noise_multiplier
    from adaclip.correlated.coefficients import optimise_banded_coefficients

    sigma = calibrate_noise_multiplier(target_epsilon=2.0, delta=1e-5, sample_rate=0.01, steps=200)
    acc = Accountant("rdp")
    acc.step(noise_multiplier=1.1, sample_rate=256 / 60000, num_steps=14062)
    assert result["sigma"] == sigma  # JSON round-trips a float exactly
    assert result["epsilon"] == acc.epsilon(1e-5)
    assert math.isclose(result["epsilon"], 2.597, rel_tol=1e-3)  # the accounting module's reference value
    assert result["coefficients"] == optimise_banded_coefficients(4, 300).tolist()
    assert result["relation"] == str(NeighboringRelation.ADD_OR_REMOVE_ONE)
    # absl.logging made "absl" its own logger class, although adaclip looked that logger up itself
    assert result["absl_logger"] == absl.logging.ABSLLogger.__name__
