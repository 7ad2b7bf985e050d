#!/usr/bin/env bash
# The checks of a lent CUDA GPU in one call, in under 10 minutes (docs/benchmarks/gpu.md says what each
# step measures, the targets it is read against, and how to prepare the call):
#
#   bash bench/device/check.sh [--dry-run] [STEPS]
#
# STEPS, comma-separated (default: tests,prefill7b,prefill8b,engine7b,decode8b,server):
#   tests      the graphed prefill's and the decode buckets' tests on CUDA (pytest --device cuda)
#   prefill7b  full / reuse / blend prefills at Llama-2-7B shape, the prefill's graphs on and off, and the
#              host time of a prefill against its GPU time (python -m bench.device.probe --parts prefill)
#   prefill8b  the same at Llama-3-8B shape (GQA)
#   engine7b   ragblend bench engine at Llama-2-7B shape on the data set's prompts: TTFT per mode, decode
#   decode8b   the batched decode step at 3k-token caches, Llama-3-8B shape (eager and CUDA-graphed buckets)
#   server     ragblend serve on a random Llama-3-8B, ingest, ragblend bench server (1, 8, 16 clients) and
#              bench server-modes (TTFT per mode; blend's requests/s against full's at 8 and 16 clients)
#   (and, not by default, the first GPU run's: decode7b, decode7b512; its shapes and packing were retired
#   in issue 64: docs/benchmarks/gpu.md)
#
# Prepare it here, once: `python -m bench.device.pack pack` writes .device/ (the tokenizer, the embedder's
# configuration, the data set) and .whl/ (the server's wheels the GPU image lacks), both ignored by git:
# name both in the call's `carry`. What comes back ($OUT): summary.md (tables and targets), summary.json
# and device_check.tar.gz (every step's log and JSON), all three rewritten after each step, so a call
# cut short still brings back what ran. Each step has a time limit of its own and a failing step does not
# stop the next. --dry-run: every step on CPU, with a tiny random model and tiny sizes, in a minute or
# two (tests/test_device_check.py runs it so that the script does not rot); the pack is made on the fly
# where $PACK has none.
set -u
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
STEPS=${1:-tests,prefill7b,prefill8b,engine7b,decode8b,server}
OUT=${OUT:-/tmp/device_check}
WORK=${WORK:-/tmp/device_check_work}
PACK=${PACK:-.device}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ -d .whl ] && [ $DRY_RUN = 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

if [ $DRY_RUN = 1 ]; then
  DEVICE=cpu M7=random:tiny-llama M8=random:tiny-llama SERVER_MODEL=random:tiny-llama
  ROUNDS=1 CHUNK=40 PASSAGES=2 QUESTIONS=1 DECODE_TOKENS=4 CONTEXT=64 BATCHES=1,2 DECODE_STEPS=2
  SERVER_SIZES="--questions 2 --passages 2 --max-tokens 4 --concurrency 1,2 --modes-clients 1 --throughput-clients 2 --rounds 1 --max-running 2"
  TESTS=${TESTS:-tests/test_prefill_graph.py -k bucket_rows}
  DATA=${DATA:-../shared/data/musique_dev.json}
  if [ ! -d "$PACK/tokenizer" ]; then
    PACK=$WORK/pack
    $PY -m bench.device.pack pack --out "$PACK" --no-wheels --data "$DATA" > "$WORK/pack.log" 2>&1 || {
      echo "the pack failed: $WORK/pack.log"; tail -n 20 "$WORK/pack.log"; exit 1; }
  fi
  SUMMARY_FLAGS=--dry-run
else
  DEVICE=cuda M7=random:llama-7b M8=random:llama-3-8b SERVER_MODEL=random:llama-3-8b
  ROUNDS=5 CHUNK=600 PASSAGES=5 QUESTIONS=3 DECODE_TOKENS=64 CONTEXT=3000 BATCHES=1,2,4,8,16 DECODE_STEPS=8
  SERVER_SIZES="--questions 16 --passages 5 --max-tokens 32 --concurrency 1,8,16 --modes-clients 8 --throughput-clients 16 --rounds 2"
  TESTS=${TESTS:-tests/test_prefill_graph.py tests/test_decode_buckets.py}
  DATA=${DATA:-$PACK/data/musique_dev.json}
  SUMMARY_FLAGS=
  nvidia-smi -L
fi
# the settings-based benches read prompts with the packed tokenizer (model.tokenizer of a random model)
if [ -d "$PACK/tokenizer" ]; then export RAGBLEND_MODEL__TOKENIZER; RAGBLEND_MODEL__TOKENIZER=$(cd "$PACK/tokenizer" && pwd); fi
$PY -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'transformers', \
transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee "$WORK/versions.txt"

summarize() {  # the tables, the targets and the archive in $OUT: after every step
  $PY -m bench.device.summary --work "$WORK" --out "$OUT" $SUMMARY_FLAGS > "$WORK/summary.log" 2>&1 \
    || tail -n 5 "$WORK/summary.log"
  tar -czf "$OUT/device_check.tar.gz" -C "$WORK" --exclude=./pack --exclude=./server/embedder . 2>/dev/null
}

step() {  # name, time limit (s), command...
  local name=$1 limit=$2
  shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return ;; esac
  local start=$SECONDS
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local code=$?
  printf '%s\t%s\t%s\n' "$name" "$code" "$((SECONDS - start))" >> "$WORK/steps.tsv"
  echo "== $name: exit $code in $((SECONDS - start)) s"
  summarize
}

step tests 80 $PY -m pytest --device $DEVICE -q -p no:cacheprovider $TESTS
step prefill7b 70 $PY -m bench.device.probe --parts prefill --model $M7 --device $DEVICE --rounds $ROUNDS \
  --chunk-tokens $CHUNK --out "$WORK/prefill_7b.json"
step prefill8b 70 $PY -m bench.device.probe --parts prefill --model $M8 --device $DEVICE --rounds $ROUNDS \
  --chunk-tokens $CHUNK --out "$WORK/prefill_8b.json"
step engine7b 90 $PY -m app.cli bench engine --device $DEVICE --model $M7 --data "$DATA" --passages $PASSAGES \
  --questions $QUESTIONS --ratios 0.15 --no-prefix-row --no-answers --decode-tokens $DECODE_TOKENS \
  --decode-questions 1 --out "$WORK/engine_7b.json"
step decode8b 70 $PY -m bench.engine.batch_decode --device $DEVICE --model $M8 --context $CONTEXT --rounds $ROUNDS \
  --steps $DECODE_STEPS --batch-sizes $BATCHES --parts batch,graphed --weights fp32 --out "$WORK/decode_8b.json"
step server 220 $PY -m bench.device.server --out-dir "$WORK/server" --model $SERVER_MODEL --device $DEVICE \
  --pack "$PACK" --data "$DATA" $SERVER_SIZES
# the first GPU run's checks (docs/benchmarks/gpu.md), by name only
step decode7b 120 $PY -m bench.engine.batch_decode --device $DEVICE --model $M7 --context $CONTEXT --rounds 3 \
  --batch-sizes $BATCHES --parts batch,graphed --out "$WORK/batch_decode_llama7b_ctx$CONTEXT.json"
step decode7b512 70 $PY -m bench.engine.batch_decode --device $DEVICE --model $M7 --context 512 --rounds 3 \
  --batch-sizes $BATCHES --parts batch,graphed --out "$WORK/batch_decode_llama7b_ctx512.json"

echo
cat "$OUT/summary.md" 2>/dev/null || echo "no summary: $WORK/summary.log"
