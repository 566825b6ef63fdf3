#!/usr/bin/env bash
# The main job: one cell of the round-three utility benchmark (benchmarks/utility/round3.py) — an
# MLP on MNIST-1D (N = 50,000, regenerated locally), SGD with momentum, ε = 3, δ = 1e-5, a long
# run (1,950 steps). DP-SGD (flat clipping, independent noise) against the library's correlated
# noise (banded matrix factorisation, b chosen by the library) with parameter averaging, with
# flat clipping and with AdaClip's default; every method at DP-SGD's tuned learning rate and clip
# norm (lr 0.2, C 1), the averaging's decay picked on a validation split, 3 seeds; σ calibrated
# with PLD, the library's default accountant (--accountant pld). Prints test
# accuracy, σ, b and the ε the accountant spent (~2–4 minutes on 2 cores).
# Extra arguments go to benchmarks/utility/round3.py (see --help), e.g. `--epsilons 1 3 8`.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch==2.13.0 pins the CPU wheel on machines that carry it; an unpinned torch would pull CUDA builds.
python -m pip install -q torch==2.13.0 -e ".[torch,bench]"
python benchmarks/utility/round3.py --task mnist1d-long --optimizer sgd --epsilons 3 --seeds 3 --lrs 0.2 --clips 1 \
  --methods flat flat+ema banded+ema adaclip+banded+ema --accountant pld --tag _main_pld --quiet "$@"
python benchmarks/utility/round3.py --report benchmarks/results/round3_mnist1d-long_torch_sgd_eps3_main_pld.json
