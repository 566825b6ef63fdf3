#!/usr/bin/env bash
# Third GPU round: JAX kernels end to end (auto on GPU), torch auto without kernels, CNN profile.
set -u
out="${OUT:-gpu_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
log="$out/round3.log"
step() { local name="$1" limit="$2"; shift 2; echo "=== $name (limit ${limit}s): $*" | tee -a "$log"; local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1; echo "=== $name: exit $? after $((SECONDS - t0))s" | tee -a "$log"; }
step jax-kernel-tests 80 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_jax_kernel.py
step torch-kernel-tests 60 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_torch_kernel.py -k "auto or rollback or noise"
step speed-jax 70 python3 benchmarks/speed_jax.py --kernel --models mlp --batches 256,1024 --rounds 5 --json "$out/speed_jax_gpu.json"
step profile-cnn 40 python3 benchmarks/speed_torch.py --device cuda --profile cnn 1024 flat_ghost+osnoise
step speed-torch 80 python3 benchmarks/speed_torch.py --device cuda --quick --models mlp,cnn --batches 256,1024 --no-memory \
  --methods nonprivate,flat_ghost+osnoise,adaclip_ghost+osnoise,opacus_ghost --json "$out/speed_torch_cuda.json"
tail -c 1500 "$log"
