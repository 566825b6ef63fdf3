"""mkdocs hook: publish the PNG plots under benchmarks/results/ on the benchmark page, and the
benchmark write-ups (``benchmarks/results/*.md``, ``benchmarks/HISTORY.md``) as pages.

The page ``benchmarks.md`` holds the marker ``<!-- benchmark-plots -->``; this hook replaces it
with one image per ``benchmarks/results/*.png`` (sorted by name) and copies those files into the
built site, so the page always shows what the repository holds. Without plots the marker becomes
a short note, and the build still passes under ``--strict``.

The benchmark page includes ``benchmarks/RESULTS.md``, the index of current verdicts, whose links
point at ``results/<name>.md`` and ``HISTORY.md`` (relative to ``benchmarks/``). The hook adds those
files to the site at the same paths relative to the docs root (``results/<name>.md``,
``HISTORY.md``), so one relative link works both in the repository and on the site; the guide
pages link to them the same way. They are not in the navigation: the index reaches them.

(The docstrings' reST markup is converted for the API pages by the griffe extension in
``griffe_rst.py``, configured under mkdocstrings in ``mkdocs.yml``.)
"""

from __future__ import annotations

import pathlib

from mkdocs.structure.files import File

MARKER = "<!-- benchmark-plots -->"
RESULTS = pathlib.Path("benchmarks") / "results"
DEST = "benchmarks/results"
WRITEUPS = pathlib.Path("benchmarks")  # results/*.md and HISTORY.md, published relative to it


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
    root = pathlib.Path(config["config_file_path"]).resolve().parent / WRITEUPS
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
    if MARKER not in markdown:
        return markdown
    plots = _plots(config)
    if not plots:
        text = "_No plots yet: `benchmarks/results/` holds no PNG files._"
    else:
        text = "\n\n".join(f"![{p.stem}]({DEST}/{p.name})\n\n`benchmarks/results/{p.name}`" for p in plots)
    return markdown.replace(MARKER, text)

