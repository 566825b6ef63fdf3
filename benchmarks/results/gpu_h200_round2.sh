#!/usr/bin/env bash
# Second GPU round: padded Pallas kernel, device-side noise, CNN/LSTM cells, HF memory.
set -u
out="${OUT:-gpu_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
log="$out/round2.log"
step() { local name="$1" limit="$2"; shift 2; echo "=== $name (limit ${limit}s): $*" | tee -a "$log"; local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1; echo "=== $name: exit $? after $((SECONDS - t0))s" | tee -a "$log"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, triton, jax; print(sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__, 'jax', jax.__version__, jax.devices())"; } >>"$log" 2>&1
step tests 90 python3 -m pytest -q -p no:cacheprovider -rxXfE tests/test_jax_kernel.py tests/test_torch_cuda_paths.py
step kernel-bench-jax 70 python3 benchmarks/kernel_bench_jax.py --json "$out/kernel_bench_jax.json"
step speed-torch 240 python3 benchmarks/speed_torch.py --device cuda --quick --models mlp,cnn,lstm --batches 256,1024 \
  --methods nonprivate,flat_ghost,flat_ghost+osnoise,flat_ghost+nokernel+osnoise,adaclip_ghost+osnoise,adaclip_ghost+nokernel+osnoise,opacus_ghost \
  --json "$out/speed_torch_cuda.json"
step profile 40 python3 benchmarks/speed_torch.py --device cuda --profile mlp 256 flat_ghost+nokernel+osnoise
step hf-memory 80 python3 benchmarks/hf_speed.py --device cuda --batches 32 --rounds 3 --json "$out/hf_speed_cuda.json"
tail -c 2000 "$log"
