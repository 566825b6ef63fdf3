"""mkdocs hook: publish the PNG plots under benchmarks/results/ on the benchmark page, and the
benchmark write-ups (``benchmarks/results/*.md``, ``benchmarks/HISTORY.md``) as pages; fail the
build when a figure of the guide is missing.

The page ``benchmarks.md`` holds the marker ``<!-- benchmark-plots -->``; this hook replaces it
with every ``benchmarks/results/*.png``, grouped by the prefix of the file name (``audit_``,
``federated_``, ``round2_``, ``utility_``: one heading each, with a line saying what the plots
show and a link to the write-up) and within a group by the kind of plot (accuracy against ε,
training curves, ...), each kind in a collapsed ``??? note`` block, and copies those files into
the built site, so the page always shows what the repository holds. A prefix it does not know
gets a group of its own. Without plots the marker becomes a short note, and the build still
passes under ``--strict``.

The benchmark page includes ``benchmarks/RESULTS.md``, the index of current verdicts, whose links
point at ``results/<name>.md`` and ``HISTORY.md`` (relative to ``benchmarks/``). The hook adds those
files to the site at the same paths relative to the docs root (``results/<name>.md``,
``HISTORY.md``), so one relative link works both in the repository and on the site; the guide
pages link to them the same way. They are not in the navigation: the index reaches them.

The guide's figures live in ``docs/images/`` and are drawn by ``python benchmarks/figures.py``,
whose module-level ``FIGURES`` list names them. The build fails (:class:`PluginError`) when a
name of that list is not a non-empty file in ``docs/images/`` (:func:`check_declared_figures`,
run when the files are collected), or when a page shows an image under ``images/`` that does not
exist (:func:`check_image_references`, on each page's Markdown: ``![alt](images/x.png)`` and
``<img src="images/x.png">``, relative to the page). ``mkdocs build --strict`` alone already
aborts on a Markdown image whose file is missing (mkdocs warns about any link it cannot resolve),
but not on a raw HTML ``<img>``, nor on a declared figure that no page shows; this check names
the command that regenerates them. ``FIGURES`` is read from the script's source (it must be a
literal list of file names), so the build needs neither matplotlib nor the library.

(The docstrings' reST markup is converted for the API pages by the griffe extension in
``griffe_rst.py``, configured under mkdocstrings in ``mkdocs.yml``.)
"""

from __future__ import annotations

import ast
import pathlib
import posixpath
import re
from collections.abc import Iterable, Mapping
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

MARKER = "<!-- benchmark-plots -->"
RESULTS = pathlib.Path("benchmarks") / "results"
DEST = "benchmarks/results"
WRITEUPS = pathlib.Path("benchmarks")  # results/*.md and HISTORY.md, published relative to it
FIGURE_SCRIPT = pathlib.Path("benchmarks") / "figures.py"  # declares FIGURES
IMAGES = "images"  # the guide's figures, under docs_dir
REGENERATE = "python benchmarks/figures.py"

#: Plot groups of the benchmark page by file-name prefix: (heading, what the plots show, write-up
#: relative to benchmarks/). In this order; unknown prefixes follow, sorted.
GROUPS: dict[str, tuple[str, str, str]] = {
    "round2": (
        "Utility, round two",
        "Test accuracy against ε of each method at an equal tuning budget (mean ± SE over seeds), "
        "and the spread of AdaCliP's learned scale over training.",
        "results/utility_round2.md",
    ),
    "utility": (
        "Utility, round one",
        "Test accuracy against ε (mean ± std over seeds), training curves, and AdaCliP's state "
        "(the scale b and the noise's std) over training, per task.",
        "results/utility_round1.md",
    ),
    "audit": (
        "Privacy audits",
        "Test accuracy, membership-attack AUC and the audited lower bound on ε against the "
        "accountant's ε, mean ± SE over seeds.",
        "results/audit.md",
    ),
    "federated": (
        "Federated training",
        "Each method's accuracy on the users' and on the public test set at one user-level ε, "
        "mean ± SE over seeds.",
        "results/federated.md",
    ),
}
#: Kinds of plot within a group, by the end of the file name.
KINDS: dict[str, str] = {
    "_vs_epsilon": "Accuracy against ε",
    "_curves": "Training curves",
    "_adaclip_state": "AdaCliP's state over training",
    "_scale_spread": "Spread of the learned scale",
}
OTHER_KIND = "Other plots"


# --------------------------------------------------------------------------- the guide's figures


def _root(config: Mapping[str, Any]) -> pathlib.Path:
    return pathlib.Path(config["config_file_path"]).resolve().parent


def _docs_dir(config: Mapping[str, Any]) -> pathlib.Path:
    docs = pathlib.Path(config["docs_dir"])
    return docs if docs.is_absolute() else _root(config) / docs


def declared_figures(script: pathlib.Path) -> list[str]:
    """The file names of the module-level ``FIGURES = [...]`` of ``script``, read from its source."""
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    except (OSError, SyntaxError) as exc:
        raise PluginError(f"cannot read the figures the guide needs from {script}: {exc}") from exc
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign):
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "FIGURES" and node.value is not None:
            try:
                names = ast.literal_eval(node.value)
            except ValueError as exc:
                raise PluginError(f"{script}: FIGURES must be a literal list of file names") from exc
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
                raise PluginError(f"{script}: FIGURES must be a literal list of file names, got {names!r}")
            return list(names)
    raise PluginError(f"{script} declares no module-level FIGURES list")


def check_declared_figures(config: Mapping[str, Any]) -> list[str]:
    """Raise :class:`PluginError` unless every figure that ``benchmarks/figures.py`` declares is
    a non-empty file in ``<docs_dir>/images/``; returns the declared names."""
    script = _root(config) / FIGURE_SCRIPT
    if not script.is_file():
        raise PluginError(
            f"{FIGURE_SCRIPT} is missing: it declares the figures in docs/{IMAGES}/ that the guide shows"
        )
    names = declared_figures(script)
    folder = _docs_dir(config) / IMAGES
    missing = [n for n in names if not (folder / n).is_file() or (folder / n).stat().st_size == 0]
    if missing:
        raise PluginError(
            f"figures declared in {FIGURE_SCRIPT} are missing (or empty) in docs/{IMAGES}/: "
            f"{', '.join(missing)}. Regenerate them with `{REGENERATE}`"
        )
    return names


_FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})[^\n]*\n.*?^\1\2[ \t]*$", re.MULTILINE | re.DOTALL)
_MD_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_HTML_IMAGE = re.compile(r"<img\b[^>]*?\bsrc\s*=\s*([\"'])(.*?)\1", re.IGNORECASE)


def image_references(markdown: str) -> list[str]:
    """The targets of the images a page's Markdown shows (``![..](..)`` and ``<img src="..">``),
    outside fenced code blocks."""
    text = _FENCE.sub("", markdown)
    return [m.group(1) for m in _MD_IMAGE.finditer(text)] + [m.group(2) for m in _HTML_IMAGE.finditer(text)]


def missing_images(markdown: str, page_uri: str, docs_dir: pathlib.Path) -> list[str]:
    """The image references of a page (``page_uri`` relative to ``docs_dir``) that point into
    ``<docs_dir>/images/`` at a file that does not exist."""
    missing = []
    for ref in image_references(markdown):
        if re.match(r"^[a-z][a-z0-9+.-]*:|^/", ref, re.IGNORECASE):  # a URL or a site-absolute path
            continue
        target = posixpath.normpath(
            posixpath.join(posixpath.dirname(page_uri), ref.split("#")[0].split("?")[0])
        )
        if target.startswith(f"{IMAGES}/") and not (docs_dir / target).is_file():
            missing.append(ref)
    return missing


def check_image_references(markdown: str, page: Any, config: Mapping[str, Any]) -> None:
    """Raise :class:`PluginError` when ``page`` shows an image under ``images/`` that is missing."""
    uri = page.file.src_uri
    missing = missing_images(markdown, uri, _docs_dir(config))
    if missing:
        raise PluginError(
            f"docs/{uri} shows images that are not in docs/{IMAGES}/: {', '.join(missing)}. "
            f"The guide's figures are drawn by `{REGENERATE}`"
        )


# --------------------------------------------------------------------------- benchmark plots


def _plots(config) -> list[pathlib.Path]:
    folder = _root(config) / RESULTS
    return sorted(folder.glob("*.png")) if folder.is_dir() else []


def _kind(stem: str) -> str:
    return next((label for end, label in KINDS.items() if stem.endswith(end)), OTHER_KIND)


def _plot_entry(png: pathlib.Path) -> str:
    return f"    ![{png.stem}]({DEST}/{png.name}){{ loading=lazy }}\n\n    `benchmarks/results/{png.name}`"


def plot_sections(plots: Iterable[pathlib.Path], root: pathlib.Path) -> str:
    """The Markdown of the benchmark page's plots: a heading per file-name prefix, a collapsed
    block per kind of plot."""
    groups: dict[str, list[pathlib.Path]] = {}
    for png in plots:
        groups.setdefault(png.stem.split("_", 1)[0], []).append(png)
    order = [p for p in GROUPS if p in groups] + sorted(p for p in groups if p not in GROUPS)
    parts = []
    for prefix in order:
        pngs = groups[prefix]
        title, what, writeup = GROUPS.get(
            prefix, (f"`{prefix}_*`", f"Plots whose file names begin with `{prefix}_`.", "")
        )
        count = f"{len(pngs)} plot{'s' if len(pngs) != 1 else ''}"
        text = [f"### {title} (`{prefix}_*.png`, {count})", ""]
        line = what
        if writeup and (root / WRITEUPS / writeup).is_file():
            line += f" Tables and write-up: [{writeup}]({writeup})."
        text += [line, ""]
        kinds: dict[str, list[pathlib.Path]] = {}
        for png in pngs:
            kinds.setdefault(_kind(png.stem), []).append(png)
        for label in [*KINDS.values(), OTHER_KIND]:
            if label in kinds:
                n = len(kinds[label])
                text += [f'??? note "{label} ({n} plot{"s" if n != 1 else ""})"', ""]
                text += ["\n\n".join(_plot_entry(p) for p in kinds[label]), ""]
        parts.append("\n".join(text))
    return "\n".join(parts)


# --------------------------------------------------------------------------- mkdocs events


def on_files(files, config):
    check_declared_figures(config)
    for png in _plots(config):
        files.append(
            File(
                f"{DEST}/{png.name}",
                src_dir=str(png.parent.parent.parent),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    root = _root(config) / WRITEUPS
    for md in [*sorted((root / "results").glob("*.md")), root / "HISTORY.md"]:
        if md.is_file():
            files.append(
                File(
                    md.relative_to(root).as_posix(),
                    src_dir=str(root),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files


def on_page_markdown(markdown, page, config, files):
    check_image_references(markdown, page, config)
    if MARKER not in markdown:
        return markdown
    plots = _plots(config)
    if not plots:
        text = "_No plots yet: `benchmarks/results/` holds no PNG files._"
    else:
        text = plot_sections(plots, _root(config))
    return markdown.replace(MARKER, text)
