#!/usr/bin/env bash
# Fifth GPU round: correlated noise on the device (banded, BLT, the quantile rule's count, make_private's
# Adam lr factor), its step cost against independent noise on CUDA, then the whole suite with CUDA visible.
set -u
out="${OUT:-gpu_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
log="$out/round5.log"
step() { local name="$1" limit="$2"; shift 2; echo "=== $name (limit ${limit}s): $*" | tee -a "$log"; local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1; echo "=== $name: exit $? after $((SECONDS - t0))s" | tee -a "$log"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, triton, jax; print(sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__, 'jax', jax.__version__, jax.devices())"; } >>"$log" 2>&1
step cuda-tests 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_torch_cuda_paths.py tests/test_torch_kernel.py \
  tests/test_torch_kernel_reference.py tests/test_jax_kernel.py
step cost-mlp 60 python3 benchmarks/correlated_cost.py --device cuda --bands 4 16 64 --blt 4 --rounds 5 --steps 30 \
  --out "$out/correlated_cost_cuda.json"
step cost-wide 70 python3 benchmarks/correlated_cost.py --device cuda --hidden 8000 --bands 4 16 64 --blt 4 --rounds 3 \
  --steps 20 --out "$out/correlated_cost_cuda_wide.json"
step suite "${SUITE_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 16 --dist loadfile -rfE \
  --ignore-glob='tests/test_flower*' --junitxml="$out/suite.xml"
python3 - "$out/suite.xml" >>"$log" 2>&1 <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:  # the suite ran out of its limit before writing the report
    print("suite.xml:", e); sys.exit()
s = root if root.tag == "testsuite" else root[0]
print("suite.xml:", {k: s.get(k) for k in ("tests", "failures", "errors", "skipped", "time")})
PY
tail -c 3000 "$log"
