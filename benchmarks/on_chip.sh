#!/usr/bin/env bash
# One chip session's measurements in one command, each stage's figures and log under $OUT (at most 8 files
# come back), every stage cut at a shared deadline so the whole stays inside a 10-minute call:
#   source .whl-tpu/setup.sh && bash benchmarks/on_chip.sh [STAGE ...]
# Stages (default: serve gmm tests):
#   serve         benchmarks/serve_weights.py: moe-1b, each weight format at 1/8/32 slots (SLOTS), and a lone
#                 stream at 8 decode steps a program (DECODE_STEPS; FORMATS: the weight formats); PROFILE=1:
#                 the decode program's ops;
#                 VARIANTS="moe.direct_assignments=8 moe.direct_assignments=0": each format with each side by side;
#                 SERVE_S: its seconds at most (330)
#   interference  benchmarks/serve_interference.py: 8 streams decoding while a 2,000-token prompt arrives
#                 (CHUNKS: the prefill chunks tried, 64; MIXED: the chunk in its own program and/or with the
#                 decode step, off,on); PROFILE=1: the decode step's and the chunk's programs' ops
#   ready         benchmarks/serve_ready.py: a server of moe-1b (trained one step here) ready, cold and warm cache;
#                 RESTORE_PARTS=1: where its checkpoint read goes; READY_SET="train.checkpoint_compression=false":
#                 overrides for the run it trains
#   gmm           benchmarks/gmm_formats.py
#   codec         benchmarks/checkpoint_codec.py: 2 GiB of weights saved and restored with orbax's zstd and without
#   rows          benchmarks/rows_product.py: a few rows times one layer's weight read from its stack, the kernel
#                 (each column tile) against XLA, bf16/int8/int4
#   tests         the `tpu` tests
#   levers        benchmarks/train_levers.py: moe-1b as written and the variants in $LEVERS; PROFILE=1: each
#                 one's device ops
#   step          benchmarks/train_step.py: time to the first step, cold and warm, with the start-up's stages
#   effort        benchmarks/compile_effort.py: moe-1b's train step compiled at XLA's effort settings
#                 (EFFORTS: base,effort-1,O0,O1), each compile's seconds and its step's
#   startup       benchmarks/startup_parts.py: a process's first seconds taken apart (python, import jax, the
#                 runtime's start alone, the trainer's and the server's imports alone and beside the runtime
#                 started on a thread), REPEAT rounds (1), with the slowest imports (-X importtime);
#                 STARTUP_PARTS: the parts (all); TRANSFER_MIB: copies of that size timed too; RUNTIME_VARIANTS: lines "LABEL K=V ...", the runtime's start alone under each, its log kept
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
deadline=$((SECONDS + ${CHIP_SECONDS:-560}))
# The packages' bytecode, compiled once a host, as the project's image has it (pip compiles it at install;
# .whl-tpu/setup.sh installs with --no-compile): without it every process's imports compile their sources.
if [ ! -f /tmp/site/.compiled ] && [ -d /tmp/site ]; then
  t=$SECONDS; python -m compileall -q -j 0 /tmp/site trainer provision > /dev/null 2>&1; touch /tmp/site/.compiled
  echo "== bytecode compiled in $((SECONDS - t))s ($(env | grep -c '^PYTHONDONTWRITEBYTECODE=') PYTHONDONTWRITEBYTECODE)" \
    | tee -a "$OUT/summary.txt"
fi
left() { echo $((deadline - SECONDS)); }
stage() {  # name seconds-at-most command...
  local name=$1 most=$2; shift 2
  local t=$(left); [ "$t" -gt "$most" ] && t=$most
  if [ "$t" -lt 20 ]; then echo "== $name: skipped, ${t}s left" | tee -a "$OUT/summary.txt"; return; fi
  echo "== $name (${t}s at most): $*" | tee -a "$OUT/summary.txt"
  local start=$SECONDS
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc $? in $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
  tail -5 "$OUT/$name.log"
}
for s in "${@:-serve gmm tests}"; do for s1 in $s; do case $s1 in
  serve) stage serve "${SERVE_S:-330}" python benchmarks/serve_weights.py --accelerator --steps 64 --repeats 3 \
           --formats "${FORMATS:-bf16,int8,int4-native}" --slots "${SLOTS:-1,8,32}" --decode-steps "${DECODE_STEPS:-1,8}" \
           $(for v in ${VARIANTS:-}; do printf -- '--variant %s ' "$v"; done) ${PROFILE:+--profile} \
           --json "$OUT/serve_weights.json" ;;
  interference) stage interference "${INTERFERENCE_S:-300}" python benchmarks/serve_interference.py --accelerator --chunks "${CHUNKS:-64}" \
                  --mixed "${MIXED:-off,on}" ${PROFILE:+--profile} --json "$OUT/interference.json" ;;
  ready) stage ready "${READY_S:-240}" python benchmarks/serve_ready.py --accelerator --log-compiles ${RESTORE_PARTS:+--restore-parts} ${WARM_VARIANTS:+--warm-variants "$WARM_VARIANTS"} \
           $(for v in ${READY_SET:-}; do printf -- '--set %s ' "$v"; done) \
           --json "$OUT/ready.json" ;;
  gmm) stage gmm 120 python benchmarks/gmm_formats.py --json "$OUT/gmm_formats.json" ;;
  codec) stage codec 150 python benchmarks/checkpoint_codec.py --gib 2 --arrays 4 --chunk-mib ${CHUNKS_MIB:-8 32 128} --json "$OUT/checkpoint_codec.json" ;;
  rows) stage rows 150 python benchmarks/rows_product.py --json "$OUT/rows_product.json" ;;
  tests) MOE_TPU_TESTS=1 stage tests 300 python -m pytest -o addopts="" -q -p no:cacheprovider -m tpu \
           tests/trainer/test_tpu.py ;;
  levers) stage levers 240 python benchmarks/train_levers.py --no-gmm --steps 10 \
            --variants ${LEVERS:-h8+splash+chunk+attention_moe,h8+dropless_megablox+splash+chunk+attention_moe} \
            ${PROFILE:+--profile} --json-out "$OUT/levers.json" ;;
  step) stage step 300 python benchmarks/train_step.py --accelerator --config moe-1b --log-compiles --steps "${STEPS:-60}" --paths "${PATHS_:-capacity}" \
          --json-out "$OUT/train_step.json" ;;
  effort) stage effort "${EFFORT_S:-200}" python benchmarks/compile_effort.py --variants "${EFFORTS:-base,effort-1,O0,O1}" \
            --json-out "$OUT/compile_effort.json" ;;
  startup) variants=(); while IFS= read -r v; do [ -n "$v" ] && variants+=(--variant "$v"); done <<< "${RUNTIME_VARIANTS:-}"
           stage startup "${STARTUP_S:-90}" python benchmarks/startup_parts.py --repeat "${REPEAT:-1}" --importtime \
             ${STARTUP_PARTS:+--parts "$STARTUP_PARTS"} ${TRANSFER_MIB:+--transfer-mib "$TRANSFER_MIB"} ${variants[@]+"${variants[@]}"} ${RUNTIME_VARIANTS:+--runtime-log 400} --json "$OUT/startup_parts.json" ;;
  *) echo "unknown stage $s1"; exit 2 ;;
esac; done; done
