#!/usr/bin/env bash
# The GPU checks, in one run of under 9 minutes on a lent H100/H200 (results: benchmarks/RESULTS.md,
# "GPU checks"): the kernel and CUDA-path tests, the kernel benchmarks (Triton and Pallas), the torch and Hugging
# Face speed benchmarks on CUDA against Opacus, then the whole suite with CUDA visible.
#
#   bash scripts/gpu_checks.sh OUTDIR
#
# Packages the GPU image lacks (dp-accounting, dm-tree, array-api-compat, opacus) are installed
# from wheels in .whl/ when it exists. Each step has its own time limit, so that a hang in one
# leaves the others their time; everything goes to OUTDIR/gpu_checks.log and JSON files.
set -u
out="${1:-gpu_out}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false ADACLIP_REQUIRE_KERNELS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
log="$out/gpu_checks.log"
step() {  # step NAME SECONDS COMMAND...
  local name="$1" limit="$2"
  shift 2
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - t0))s" | tee -a "$log"
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, triton, jax; print(sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__, 'jax', jax.__version__, jax.devices())"
} >>"$log" 2>&1
step kernel-tests 100 python3 -m pytest -x -q -p no:cacheprovider tests/test_torch_kernel.py \
  tests/test_torch_kernel_reference.py tests/test_jax_kernel.py tests/test_torch_cuda_paths.py
step kernel-bench 45 python3 benchmarks/kernel_bench.py --json "$out/kernel_bench.json"
step kernel-bench-jax 60 python3 benchmarks/kernel_bench_jax.py --json "$out/kernel_bench_jax.json"
step speed-torch 100 python3 benchmarks/speed_torch.py --device cuda --quick --batches 256,1024 \
  --methods nonprivate,flat_ghost,flat_ghost+nokernel,adaclip_ghost,adaclip_ghost+nokernel,opacus_hooks,opacus_ghost \
  --json "$out/speed_torch_cuda.json"
step hf-speed 90 python3 benchmarks/hf_speed.py --device cuda --batches 32 --rounds 5 --no-memory \
  --json "$out/hf_speed_cuda.json"
step suite "${SUITE_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 16 --dist loadfile -rfE \
  --junitxml="$out/suite.xml"
