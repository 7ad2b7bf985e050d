#!/usr/bin/env bash
# The checks of a lent CUDA GPU in one call (docs/benchmarks/gpu.md says what each measures): the
# engine tests on CUDA, the batched decode at Llama-2-7B shape (eager and CUDA-graphed buckets, at two
# context lengths), and the engine bench at 7B shape. Each step has a time limit of its own, its log
# and JSON go to $OUT, and a failing step does not stop the next.
#
#   bash bench/device_check.sh [tests,decode,decode512,decode1024,shapes,packing,engine]
#
# Where the host's Python lacks the project's pure-Python dependencies, `.whl/` holds them
# (../shared/tools/device-wheels.sh zstandard uvicorn python-multipart); the dev set is read from
# $DATA (default ../shared/data/musique_dev.json: copy it into the checkout where ../shared does not travel).
set -u
OUT=${OUT:-/tmp/device_check}
DATA=${DATA:-../shared/data/musique_dev.json}
STEPS=${1:-tests,decode,decode512,shapes,engine}
TESTS=${TESTS:-tests/test_engine_forward.py tests/test_engine_blend.py tests/test_engine_plan.py \
tests/test_engine_selection.py tests/test_engine_edge_cases.py tests/test_batch_decode.py tests/test_kv_device_tier.py \
tests/test_decode_cache.py tests/test_attention_scale.py tests/test_prefill_steps.py tests/test_decode_buckets.py}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi -L
python3 -c "import sys, torch, transformers, numpy; print(sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())"

step() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return ;; esac
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - start)) s"
}

step tests 120 python3 -m pytest --device cuda -q -p no:cacheprovider --timeout 120 $TESTS
step decode 120 python3 -m bench.batch_decode_bench --device cuda --model random:llama-7b --context 3000 --rounds 3 \
  --batch-sizes 1,2,4,8,16 --parts batch,graphed --out "$OUT/batch_decode_llama7b_ctx3000.json"
step decode512 70 python3 -m bench.batch_decode_bench --device cuda --model random:llama-7b --context 512 --rounds 3 \
  --batch-sizes 1,2,4,8,16 --parts batch,graphed --out "$OUT/batch_decode_llama7b_ctx512.json"
step decode1024 70 python3 -m bench.batch_decode_bench --device cuda --model random:llama-7b --context 1024 --rounds 3 \
  --batch-sizes 1,8,16 --parts graphed --out "$OUT/batch_decode_llama7b_ctx1024.json"
step shapes 90 python3 -m bench.device_probe --parts shapes
step packing 60 python3 -m bench.prefill_packing_bench --device cuda --model random:llama-7b \
  --out "$OUT/prefill_packing_llama7b.json"
step engine 120 python3 -m app.cli bench engine --device cuda --model random:llama-7b --data "$DATA" \
  --passages 5 --questions 5 --no-prefix-row --out "$OUT/engine_llama7b.json"

for name in tests decode decode512 decode1024 shapes packing engine; do
  [ -f "$OUT/$name.log" ] || continue
  echo; echo "==== $name (last lines)"
  grep -v '^{' "$OUT/$name.log" | tail -n 28
done
