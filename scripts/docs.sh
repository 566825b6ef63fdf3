#!/usr/bin/env bash
# Build the documentation site (mkdocs-material + mkdocstrings) into site/, failing on any
# warning. The benchmark page includes benchmarks/RESULTS.md and the changelog page CHANGELOG.md
# at build time, and a build hook (docs/hooks/build.py) publishes any PNG plots under
# benchmarks/results/, so nothing is copied by hand and nothing goes stale.
# Extra arguments go to `mkdocs build` (e.g. `bash scripts/docs.sh --site-dir /tmp/site`).
# `python -m mkdocs serve` previews the site locally after this has installed the tools.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[docs]"
export NO_MKDOCS_2_WARNING=1   # silence mkdocs-material's banner about its successor
python -m mkdocs build --strict "$@"
