"""The documentation's code runs, and the names it mentions exist.

Every runnable program shown on the site lives in ``docs/snippets/`` and is included into the
pages with ``--8<--``; these tests run each of them in a fresh interpreter (a few in the default,
fast selection, all of them with ``-m slow``), check that every snippet is shown somewhere and
every include points at a file, and resolve every dotted ``adaclip``/``adaclip_torch``/
``adaclip_jax``/``adaclip_flower`` name written in the pages.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SNIPPETS = DOCS / "snippets"
PAGES = sorted(p for p in DOCS.rglob("*.md"))

# Fast enough for the default selection (a few seconds each); the rest run with -m slow.
FAST = {
    "core_reference.py",
    "core_step.py",
    "estimators.py",
    "accounting.py",
    "layer_scales.py",
    "torch_quickstart.py",
    "torch_audit.py",
    "jax_quickstart.py",
}

INCLUDE = re.compile(r'--8<--\s+"([^"]+?)(?::[\w-]*)*"')  # "path", "path:section", "path:start:end"
DOTTED = re.compile(r"\b(adaclip(?:_torch|_jax|_flower)?(?:\.[A-Za-z_]\w*)+)")


def _needs(name: str) -> list[str]:
    if name.startswith("flower_"):
        return ["torch", "flwr"]
    if name in ("torch_huggingface.py", "torch_hf_trainer.py"):
        return ["torch", "transformers"]
    if name == "torch_huggingface_lora_checkpoint.py":
        return ["torch", "transformers", "peft"]
    if name.startswith("torch_") or name == "migrate_opacus.py":
        return ["torch"]
    if name.startswith("jax_") or name.startswith("migrate_optax"):
        return ["jax", "optax"]
    return []


def _params():
    out = []
    for path in sorted(SNIPPETS.glob("*.py")):
        marks = [] if path.name in FAST else [pytest.mark.slow]
        if _needs(path.name):
            marks.append(getattr(pytest.mark, _needs(path.name)[0]))
        out.append(pytest.param(path, marks=marks, id=path.name))
    return out


@pytest.mark.parametrize("path", _params())
def test_snippet_runs(path: pathlib.Path) -> None:
    for module in _needs(path.name):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(
        [sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"


def test_every_include_exists_and_every_snippet_is_shown() -> None:
    included = set()
    for page in PAGES:
        for target in INCLUDE.findall(page.read_text(encoding="utf-8")):
            assert (ROOT / target).is_file(), f"{page.relative_to(ROOT)} includes missing {target}"
            included.add((ROOT / target).resolve())
    for path in SNIPPETS.glob("*.py"):
        assert path.resolve() in included, f"{path.name} is not shown on any page"


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_dotted_names_in_the_pages_exist() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    # adaclip_flower needs flwr, an optional dependency (a GPU image without it failed here)
    without_flower = importlib.util.find_spec("flwr") is None
    missing = []
    for page in PAGES:
        if "snippets" in page.parts:
            continue
        for name in set(DOTTED.findall(page.read_text(encoding="utf-8"))):
            if without_flower and name.startswith("adaclip_flower"):
                continue
            if not _resolve(name.rstrip(".")):
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, "names in the docs that do not exist:\n" + "\n".join(sorted(missing))
