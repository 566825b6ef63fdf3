#!/usr/bin/env bash
# The main job: one cell of the round-two utility benchmark (benchmarks/utility/round2.py) — a
# small MLP on scikit-learn's digits, wrapped Adam, ε = 1, δ = 1e-5. Flat clipping (DP-SGD) and
# AdaClip's default (the centred preset, `ada-tensor` in the benchmark) each get the same
# 4-configuration grid (learning rate × C) picked on a validation split, and each is also run
# without tuning (C = 1, learning rate picked); the patent's AdaCliP at its own defaults runs too.
# Every winner is retrained on 3 seeds; prints test accuracy, σ and the ε the accountant spent.
# Extra arguments go to benchmarks/utility/round2.py (see --help), e.g. `--epsilons 1 3 8`.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch==2.13.0 pins the CPU wheel on machines that carry it; an unpinned torch would pull CUDA builds.
python -m pip install -q torch==2.13.0 -e ".[torch,bench]"
python benchmarks/utility/round2.py --task digits-mlp --optimizer adam --epsilons 1 --seeds 3 \
  --methods flat ada-tensor --tag _main "$@"
