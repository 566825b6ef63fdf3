#!/usr/bin/env bash
# Sixth GPU round (2026-11-28): the standing checks of scripts/gpu_checks.sh in a tighter budget, the
# still-unmeasured items (JAX ghost tests after the HIGHEST-precision fix, torch under reduced matmul
# precision, JAX flat clipping after the drop_units fix, kernel_bench_jax linear-4M at n = 1,024,
# Hugging Face peak memory on CUDA against Opacus), the release kernels' bandwidth, a profile of the
# per-step host work against Opacus, the banded update at b = 64, and torch.compile of the release.
#   OUT=dir bash benchmarks/results/gpu_h200_round6.sh      (from the repository root; .whl/ carried)
set -u
out="${OUT:-gpu_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
log="$out/round6.log"
step() { local name="$1" limit="$2"; shift 2; echo "=== $name (limit ${limit}s): $*" | tee -a "$log"; local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1; echo "=== $name: exit $? after $((SECONDS - t0))s" | tee -a "$log"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, triton, jax, transformers, peft, opacus; print(sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__, 'jax', jax.__version__, jax.devices(), 'transformers', transformers.__version__, 'peft', peft.__version__, 'opacus', opacus.__version__)"; } >>"$log" 2>&1
step cuda-tests 160 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 12 --dist loadfile -rfE \
  --junitxml="$out/cuda_tests.xml" \
  tests/test_torch_cuda_paths.py tests/test_torch_kernel.py tests/test_torch_kernel_reference.py tests/test_jax_kernel.py \
  tests/test_jax_ghost.py tests/test_torch_matmul_precision.py tests/test_torch_fsdp.py tests/test_torch_engines.py \
  tests/test_torch_optimizer.py tests/test_torch_privacy_holes.py tests/test_averaging.py tests/test_jax_averaging.py \
  tests/test_jax_transform.py tests/test_torch_compile_release.py
step kernel-bench 40 python3 benchmarks/kernel_bench.py --sizes 1e6 1e7 3e7 --json "$out/kernel_bench.json"
step kernel-bench-jax 45 python3 benchmarks/kernel_bench_jax.py --models linear-4M --n 1024 --json "$out/kernel_bench_jax.json"
step speed-jax 50 python3 benchmarks/speed_jax.py --models mlp --batches 256,1024 --rounds 5 \
  --methods optax_dpsgd,flat_clip,ghost,adaclip --json "$out/speed_jax.json"
step profile-ours 25 python3 benchmarks/speed_torch.py --device cuda --profile mlp 256 flat_ghost+osnoise
step profile-opacus 25 python3 benchmarks/speed_torch.py --device cuda --profile mlp 256 opacus_ghost
step hf-memory 100 python3 benchmarks/hf_speed.py --device cuda --batches 32 --rounds 2 --memory-jobs 8 \
  --methods nonprivate,flat_auto,flat_ghost,adaclip_auto,opacus_hooks+ids,opacus_ghost+ids --json "$out/hf_cuda.json"
step banded-cost 40 python3 benchmarks/correlated_cost.py --device cuda --bands 16 64 --rounds 5 --steps 30 \
  --out "$out/correlated_cost.json"
python3 - "$out/cuda_tests.xml" >>"$log" 2>&1 <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    print("cuda_tests.xml:", e); sys.exit()
s = root if root.tag == "testsuite" else root[0]
print("cuda_tests.xml:", {k: s.get(k) for k in ("tests", "failures", "errors", "skipped", "time")})
PY
tail -c 4000 "$log"
