#!/usr/bin/env bash
# The main job: AdaCliP against flat clipping at the same (ε, δ) on a real data set, printing
# test accuracy and ε. Extra arguments go to the example (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[bench]"
python examples/numpy_digits.py "$@"
