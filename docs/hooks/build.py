"""mkdocs hook: publish the PNG plots under benchmarks/results/ on the benchmark page.

The page ``benchmarks.md`` holds the marker ``<!-- benchmark-plots -->``; this hook replaces it
with one image per ``benchmarks/results/*.png`` (sorted by name) and copies those files into the
built site, so the page always shows what the repository holds. Without plots the marker becomes
a short note, and the build still passes under ``--strict``.

(The docstrings' reST markup is converted for the API pages by the griffe extension in
``griffe_rst.py``, configured under mkdocstrings in ``mkdocs.yml``.)
"""

from __future__ import annotations

import pathlib

from mkdocs.structure.files import File

MARKER = "<!-- benchmark-plots -->"
RESULTS = pathlib.Path("benchmarks") / "results"
DEST = "benchmarks/results"


def _plots(config) -> list[pathlib.Path]:
    root = pathlib.Path(config["config_file_path"]).resolve().parent
    folder = root / RESULTS
    return sorted(folder.glob("*.png")) if folder.is_dir() else []


def on_files(files, config):
    for png in _plots(config):
        files.append(
            File(
                f"{DEST}/{png.name}",
                src_dir=str(png.parent.parent.parent),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    plots = _plots(config)
    if not plots:
        text = "_No plots yet: `benchmarks/results/` holds no PNG files._"
    else:
        text = "\n\n".join(f"![{p.stem}]({DEST}/{p.name})\n\n`benchmarks/results/{p.name}`" for p in plots)
    return markdown.replace(MARKER, text)

