"""The guide's figures: ``benchmarks/figures.py`` draws them from the recorded runs, and the docs
build hook (``docs/hooks/build.py``) fails when one is missing."""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytest.importorskip("matplotlib")
mkdocs_exceptions = pytest.importorskip("mkdocs.exceptions")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def figures():
    return _load("guide_figures", ROOT / "benchmarks" / "figures.py")


@pytest.fixture(scope="module")
def hook():
    return _load("docs_build_hook", ROOT / "docs" / "hooks" / "build.py")


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_SIGNATURE)


# --------------------------------------------------------------------------- the figure script


def test_every_declared_figure_is_drawn_from_the_recorded_runs(figures, tmp_path):
    written = figures.generate(tmp_path, checkpoints=3)
    assert [p.name for p in written] == figures.FIGURES
    for path in written:
        assert path.parent == tmp_path
        assert _is_png(path), path


def test_the_figures_in_the_tree_are_the_declared_ones(figures):
    for name in figures.FIGURES:
        assert _is_png(ROOT / "docs" / "images" / name), name


def test_accuracy_is_the_recorded_mean_and_standard_error(figures):
    cell = figures.load_main_job(3.0)["cell"]
    mean, se, n = figures.accuracy_summary(cell, "flat")
    runs = [r["metric"] for r in cell["final"]["flat"]["runs"]]
    assert n == len(runs) == 3
    assert mean == pytest.approx(100 * cell["final"]["flat"]["test"]["mean"])
    assert se == pytest.approx(100 * cell["final"]["flat"]["test"]["std"] / math.sqrt(n))


def test_epsilon_over_steps_counts_compositions_as_the_optimizer_records_them(figures):
    kw = {"sigma": 2.0, "sample_rate": 0.01, "steps": 40, "mechanism": "rdp", "delta": 1e-5}
    # banded, b = 4: steps 1..4 are one composition at rate 4q, step 5 opens the next
    eps = figures.epsilon_over_steps(bands=4, checkpoints=[1, 4, 5, 40], **kw)
    assert eps[0] == eps[1] < eps[2] < eps[3]
    independent = figures.epsilon_over_steps(bands=1, checkpoints=[1, 2], **kw)
    assert 0 < independent[0] < independent[1]


def test_noise_of_the_running_sum(figures):
    per_step, running = figures.noise_std_per_step_and_sum(1, 10, 0.5)
    assert per_step == pytest.approx([0.5] * 10)
    assert running == pytest.approx([0.5 * math.sqrt(t) for t in range(1, 11)])
    # banded noise: larger per step, smaller summed (the point of the picture)
    per_step, running = figures.noise_std_per_step_and_sum(8, 500, 1.0)
    assert per_step[-1] > 1.0 and running[-1] < math.sqrt(500)
    corr = figures.noise_correlation_matrix(8, 24)
    assert corr == pytest.approx(corr.T)
    assert corr.diagonal() == pytest.approx(1.0)
    assert corr[12, 11] < 0  # anti-correlated with the previous step


# --------------------------------------------------------------------------- the docs build hook


def _fake_site(tmp_path: Path, figures_present: list[str]) -> dict[str, str]:
    """A repository with the real figure script and docs/images holding ``figures_present``."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "figures.py", tmp_path / "benchmarks" / "figures.py")
    images = tmp_path / "docs" / "images"
    images.mkdir(parents=True)
    for name in figures_present:
        shutil.copy(ROOT / "docs" / "images" / name, images / name)
    (tmp_path / "mkdocs.yml").write_text("site_name: t\n")
    return {"config_file_path": str(tmp_path / "mkdocs.yml"), "docs_dir": str(tmp_path / "docs")}


def test_hook_passes_with_every_declared_figure(figures, hook, tmp_path):
    config = _fake_site(tmp_path, figures.FIGURES)
    assert hook.check_declared_figures(config) == figures.FIGURES


def test_hook_fails_when_a_declared_figure_is_missing(figures, hook, tmp_path):
    config = _fake_site(tmp_path, figures.FIGURES[1:])
    with pytest.raises(mkdocs_exceptions.PluginError, match=figures.FIGURES[0]):
        hook.check_declared_figures(config)
    with pytest.raises(mkdocs_exceptions.PluginError, match=figures.FIGURES[0]):
        hook.on_files([], config)


def test_hook_fails_on_an_empty_figure_or_a_missing_declaration(figures, hook, tmp_path):
    config = _fake_site(tmp_path, figures.FIGURES)
    (tmp_path / "docs" / "images" / figures.FIGURES[-1]).write_bytes(b"")
    with pytest.raises(mkdocs_exceptions.PluginError, match=figures.FIGURES[-1]):
        hook.check_declared_figures(config)
    (tmp_path / "benchmarks" / "figures.py").write_text('"""No FIGURES here."""\n')
    with pytest.raises(mkdocs_exceptions.PluginError, match="FIGURES"):
        hook.check_declared_figures(config)


def test_hook_fails_when_a_page_shows_a_missing_image(hook, tmp_path):
    config = _fake_site(tmp_path, ["noise_correlation.png"])
    page = SimpleNamespace(file=SimpleNamespace(src_uri="guide/page.md"))
    fine = textwrap.dedent("""\
        ![ok](../images/noise_correlation.png){ loading=lazy }
        ![remote](https://example.org/images/x.png) ![elsewhere](../other/x.png)
        ```markdown
        ![only an example](../images/not-there.png)
        ```
        """)
    assert hook.on_page_markdown(fine, page, config, None) == fine
    for bad in ("![gone](../images/gone.png)", '<img alt="x" src="../images/gone.png">'):
        with pytest.raises(mkdocs_exceptions.PluginError, match="gone.png"):
            hook.on_page_markdown(fine + bad, page, config, None)


def test_benchmark_plots_are_grouped_by_prefix(hook, tmp_path):
    names = [
        "audit_a_vs_epsilon",
        "round2_t_sgd_vs_epsilon",
        "round2_t_sgd_scale_spread",
        "zeta_x",
        "utility_t_curves",
    ]
    plots = [tmp_path / f"{n}.png" for n in names]
    text = hook.plot_sections(sorted(plots), tmp_path)
    headings = [line for line in text.splitlines() if line.startswith("### ")]
    assert [h.split(" (")[0] for h in headings] == [
        "### Utility, round two",
        "### Utility, round one",
        "### Privacy audits",
        "### `zeta_*`",
    ]
    assert '??? note "Accuracy against ε (1 plot)"' in text
    assert '??? note "Spread of the learned scale (1 plot)"' in text
    for n in names:
        assert f"    ![{n}](benchmarks/results/{n}.png)" in text


def test_strict_build_of_a_small_site_fails_without_the_figures(figures, tmp_path):
    """End to end: mkdocs with the hook aborts when a declared figure is missing."""
    pytest.importorskip("mkdocs")
    config = _fake_site(tmp_path, figures.FIGURES)
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n![pic](images/noise_correlation.png)\n")
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: t\nstrict: true\nhooks:\n  - {ROOT / 'docs' / 'hooks' / 'build.py'}\n"
    )
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    env = {"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}
    ok = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    (Path(config["docs_dir"]) / "images" / figures.FIGURES[0]).unlink()
    failed = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert failed.returncode != 0
    assert figures.FIGURES[0] in failed.stderr + failed.stdout
