#!/usr/bin/env bash
# The main job: a run of the utility benchmark (benchmarks/utility/) — a small MLP on
# scikit-learn's digits trained with AdaCliP, flat clipping (DP-SGD), per-layer clipping and
# eDP-SGD scaling at the same (ε, δ), each tuned on a validation split with the same budget,
# then retrained on 3 seeds; prints test accuracy, σ and the ε the accountant spent.
# Extra arguments go to benchmarks/utility/run.py (see --help), e.g. `--epsilons 1 3 8`.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch==2.13.0 pins the CPU wheel on machines that carry it; an unpinned torch would pull CUDA builds.
python -m pip install -q torch==2.13.0 -e ".[torch,bench]"
python benchmarks/utility/run.py --task digits-mlp --quick --epsilons 3 --seeds 3 --tag _main "$@"
