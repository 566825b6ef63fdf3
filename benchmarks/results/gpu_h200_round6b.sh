#!/usr/bin/env bash
# Sixth GPU round, second run (2026-11-28): the torch.compile fix and batch provenance on the image's
# torch 2.11; what provenance tracking costs a Hugging Face step on CUDA (this tree against .oldtree/, the
# same code before it, run alternately); where the GPT-2 full fine-tuning step spends its GPU time.
#   OUT=dir bash benchmarks/results/gpu_h200_round6b.sh     (from the repository root; .whl/ and .oldtree/ carried)
set -u
out="${OUT:-gpu_out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
log="$out/round6b.log"
step() { local name="$1" limit="$2"; shift 2; echo "=== $name (limit ${limit}s): $*" | tee -a "$log"; local t0=$SECONDS
  timeout "$limit" "$@" >>"$log" 2>&1; echo "=== $name: exit $? after $((SECONDS - t0))s" | tee -a "$log"; }
new="/tmp/site:$PWD"; old="/tmp/site:$PWD/.oldtree"
hf="--device cuda --models gpt2,bert --modes full --batches 32 --rounds 5 --no-memory --methods nonprivate,flat_auto+osnoise,opacus_hooks+ids,opacus_ghost+ids"
step tests 100 env PYTHONPATH="$new" python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 4 -rfE -m "slow or not slow" \
  tests/test_torch_compile_release.py tests/test_torch_batch_provenance.py
for r in 1 2; do
  step "hf-new-$r" 45 env PYTHONPATH="$new" python3 benchmarks/hf_speed.py $hf --json "$out/hf_new_$r.json"
  step "hf-old-$r" 45 env PYTHONPATH="$old" python3 .oldtree/benchmarks/hf_speed.py $hf --json "$out/hf_old_$r.json"
done
step profile 40 env PYTHONPATH="$new" python3 benchmarks/hf_speed.py --device cuda --profile gpt2 full 32 flat_auto+osnoise
tail -c 2500 "$log"
