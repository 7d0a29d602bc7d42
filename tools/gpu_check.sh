#!/usr/bin/env bash
# Checks on the lent GPU host, each step under its own time limit so that a hung kernel costs
# minutes, not the lease. Full logs and result files go to $OUT (or ./out); one line per step
# comes back. The exit status is non-zero when any step failed, was killed at its limit, or
# ran no test (pytest exit code 5).
#
#   source .gpu/prelude.sh && bash tools/gpu_check.sh MODE [ARGS]
#
#   tests           the GPU tests file by file, 300 s a file, 120 s a test (pytest-timeout)
#   alltests [K]    every GPU test (K: a -k expression; IDS=FILE: the tests FILE lists) in $SHARDS
#                   (12; 8 under 120 GB) pytest processes at once, and one more running the tests
#                   marked bigmem one at a time (a shard that ran out of memory:
#                   its failed tests once more, alone, after them; a shard killed at its limit: its
#                   tests that did not pass listed in unfinished.txt), $TEST_SECS (540) in all: the
#                   DSL compiles, one core each, run in parallel
#   bench [TAG]     the five one-GPU shapes: the expert path (mok_cute), the megakernel at R = 1
#                   (mok_megakernel), the torch._grouped_mm pipeline and cuBLAS, $ROUNDS (5)
#                   alternating rounds (~4 min on a warm machine)
#   sonic [TAG]     SonicMoE compiled and autotuned into ./.quack_cache (1.5-3.5 min a shape on a
#                   cold machine), then the five shapes with SonicMoE beside mok_cute. A call that
#                   runs out of time in the warm-up fails: call again within 30 s, while the
#                   machine is warm it keeps the cache and goes on where it stopped
#   train [TAG]     the training bench (mok-cute bench --train: mok_cute and the torch pipeline
#                   under autograd, fwd/bwd/train passes, $ROUNDS (3) rounds) on the five shapes,
#                   then the training tests (compile, bench) beside examples/train_tiny_moe.py
#   fp8 [TAG]       (FP8_TESTS=0: skip the tests) the FP8 path's GPU tests (test_fp8_path.py, test_gemm_fp8*.py,
#                   test_fp8_training.py, test_quantize_kernels.py), then the forward bench of mok_cute,
#                   mok_cute_fp8 and the torch pipelines (bf16, and FP8 on torch._scaled_grouped_mm)
#                   on the five shapes
#   fp8train [TAG]  the training bench of mok_cute, mok_cute_fp8 and the torch pipelines (bf16, and
#                   FP8 on torch._scaled_grouped_mm) on the five shapes, $ROUNDS (2) rounds
#   fp8probe        tools/layer_profile.py --fp8, fp8_gemm_probe.py, backward_profile.py --fp8, the
#                   FP8 weight gradients' GPU tests (kernel, quantizer, layer with the size threshold
#                   lowered) and fp8_wgrad_probe.py --layer (~8 min): the FP8 forward's stages, the
#                   FP8 GEMMs per tile width, the FP8 dgrads and weight gradients beside bf16, the
#                   column quantizers' bandwidth, the FP8 backward with FP8 / bf16 weight
#                   gradients, JSON under $OUT
#   vtrain [TAG]    training on 8 virtual ranks against one rank with the same work (mok-cute bench
#                   --train, contenders mok_megakernel and mok_virtual) on MoK's four shapes, T = 2048
#   mkbwd [SHAPES]  the backward megakernel: its GPU tests (test_megakernel_backward.py), then
#                   tools/megakernel_backward_probe.py (its dgrads and the whole backward against
#                   the two-launch dgrads, interleaved rounds), JSON under $OUT (~3 min)
#   stages [SHAPES] operand stage caps: tools/operand_stages_probe.py (every one-GPU bf16 GEMM
#                   launch at stages fit / 3 / 2, $STAGES_FLAGS added, e.g. --fp8 for the FP8
#                   launches too; default shapes: gptoss, qwen3 and gptoss at other rows an
#                   expert, dsv3), JSON under $OUT after each shape (~9 min cold); STAGES_TESTS=1
#                   first runs the GPU tests of FC1's dgrad on 3 stages (the 3-stage launch
#                   bitwise the 4-stage one, then test_backward.py; alltests has them too)
#   bwdtimeline [SHAPES]  the backward megakernel's recorder: its GPU tests (-k "recorder or
#                   config_timeline": the kernel, and MoKConfig(timeline=True) under autograd), then
#                   `mok-cute timeline --backward` per shape (qwen3_30b, dsv3_ep8_rank: trace, PNG,
#                   summary under $OUT/timeline_bwd_SHAPE/) (~8 min cold)
#   bwdgroup [SHAPE] rank 0 of 8 virtual ranks' group backward (qwen3.5_397b) with its comm CTAs
#                   and group tail, recorded (group_backward_probe --one-rank --timeline) (~6 min)
#   shared [SHAPES] the shared expert's backward inside the backward megakernel: its GPU tests
#                   (-k shared), then tools/group_backward_probe.py on 8 virtual ranks (inside the
#                   launch / a launch of its own / rank by rank, bf16 and FP8) and rank 0 alone with
#                   the group tail, JSON under $OUT (~9 min)
#   maingrad [SHAPES] the weight gradients added into fp32 main_grad: its GPU tests (-k main_grad),
#                   then tools/main_grad_probe.py (fused against bf16 gradients + main_grad.add_,
#                   interleaved rounds, the five shapes; MAINGRAD_MODES=reduce,load: the bf16
#                   launch's two ways of adding timed apart instead), JSON under $OUT
#   sanitize        tools/sanitize.py (expert path, training backward, megakernel R = 1, virtual
#                   R = 2 and 4 and its training step, a group's backward on virtual buffers, a shared
#                   expert, a wrapping ring, main_grad added into; T = 300, H = 512) under
#                   compute-sanitizer memcheck, racecheck and synccheck at once; fails on any finding
#   ncu [SHAPES]    Nsight Compute on one layer call of each path (tools/ncu_layer.py; $NCU_CONFIG,
#                   default precision=fp8, KEY=VALUE fields apart by spaces, each a --mok-config,
#                   e.g. "precision=fp8 megakernel.tickets=dynamic"): per shape (default qwen3_30b,gptoss_120b)
#                   the SourceCounters / SpeedOfLight sections of the GEMM launches and the megakernel
#                   (tools/ncu_source_summary.py: stall PCs, every mbarrier wait's retry-loop share;
#                   durations, SM / L2 / DRAM throughput), then their DRAM, L2 sector and request
#                   counters of each launch (tools/ncu_summary.py --per-launch); CSVs gzipped under $OUT (~1 min a shape)
#                   NCU_BACKWARD=1: one bf16 backward of each shape instead (NCU_CONFIG unused; its four GEMM
#                   launches against the backward megakernel; tools/ncu_layer.py --backward)
#   ep [N] [PARTS]  on a machine of N >= 2 GPUs (default: all): PARTS (default all, comma-
#                   separated) of check (tools/ep_check.py, bf16 and kimi), example (the example
#                   under torchrun, trained, rank 0's timeline; FP8 too), bench (`mok-cute bench
#                   --ep`), train (`bench --ep --train` against NCCL + torch autograd), with the IPC
#                   megakernel. All four take up to 29 min cold: one call each for check,example
#                   and bench,train
#
# Every mode stops starting steps when $DEADLINE_S (570) seconds of the call have passed and
# cuts a step's limit to what is left, so the summary comes back before the device's 600 s
# per-call limit ends the call (a step not run says SKIPPED). The call's clock starts at
# $CALL_T0 (epoch seconds) when set, else when this script starts: begin a call with
# `export CALL_T0=$(date +%s); source .gpu/prelude.sh && ...` so the prelude's unpacking counts.
set -u
out="${OUT:-out}"
mkdir -p "$out"
mode="${1:-tests}"
# NVLink multicast stays off on shared hosts (set before NCCL or symmetric memory start)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# SonicMoE (quack) caches its compiled kernels and autotuning here: the machine keeps the
# working tree's ignored files between calls while it stays warm
export QUACK_CACHE_DIR="$PWD/.quack_cache" QUACK_CACHE_AUTOTUNING=1
PYTEST=(python3 -m pytest -p no:cacheprovider -W ignore --tb=short)
SHAPES5=qwen3_30b,gptoss_120b,mixtral,dsv3_ep8_rank,sonic_120b
failures=0
deadline="${DEADLINE_S:-570}"
call_t0="${CALL_T0:-$(date +%s)}"

step() {
  # step NAME SECONDS COMMAND...: COMMAND under a hard time limit (at most what is left of
  # $deadline), its output in $out/NAME.log; prints one line (and the log's failures) and counts
  # a failure unless it exited 0; with under 20 s left it is SKIPPED (a failure too)
  local name="$1" secs="$2" rc
  shift 2
  local left=$((deadline - $(date +%s) + call_t0))
  if [ "$left" -lt 20 ]; then
    printf '%-34s SKIPPED: %s s of the call left\n' "$name" "$left"
    failures=$((failures + 1))
    return 124
  fi
  [ "$secs" -gt "$left" ] && secs=$left
  timeout -s KILL "$secs" "$@" > "$out/$name.log" 2>&1
  rc=$?
  local note
  note=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected)|no tests ran" "$out/$name.log" \
    | tail -1 | cut -c1-150)
  case $rc in
    0) ;;
    137) note="KILLED at its ${secs} s limit; ${note:-no summary}" ;;
    5) note="NO TESTS RAN (pytest exit code 5)" ;;
  esac
  printf '%-34s rc=%-4s %s\n' "$name" "$rc" "$note"
  if [ "$rc" -ne 0 ]; then
    failures=$((failures + 1))
    # pytest's summary lines of failed tests, or a script's final exception line
    grep -E "^(FAILED|ERROR) |^[A-Za-z_.]*(Error|Exception): " "$out/$name.log" | head -6 | cut -c1-220
  fi
  return "$rc"
}

bench_rows_ok() {
  # bench_rows_ok LOG: every contender of the run's JSON (the log names it) was timed
  local json
  json=$(grep -oE "^json +\S+" "$1" | awk '{print $2}')
  grep -E "│" "$1" | cut -c1-200 | tail -14
  python3 - "$json" <<'PY' || failures=$((failures + 1))
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
except (OSError, ValueError, KeyError) as exc:
    sys.exit(f"no result JSON ({exc})")
bad = [f"  {r['shape']} {r['contender']}: {r.get('status')} {str(r.get('error', ''))[:150]}"
       for r in rows if r.get("status") != "ok"]
sys.exit("contenders not timed:\n" + "\n".join(bad) if bad else 0)
PY
}

run_tests() {
  local f t0=$SECONDS
  for f in $(grep -lE "mark\.gpu" tests/test_*.py); do  # the files with GPU tests
    step "$(basename "$f" .py)" 300 "${PYTEST[@]}" -q -m gpu -o timeout=120 "$f"
  done
  echo "tests took $((SECONDS - t0)) s"
}

run_alltests() {
  # 12 shards fit an H200's 141 GB; on an 80 GB H100 some of the large-shape tests then ran
  # out of memory together (2026-12-05): 8 shards there
  local expr="${1:-}" shards i n mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  shards="${SHARDS:-$([ "${mib:-0}" -ge 120000 ] && echo 12 || echo 8)}"
  if [ -n "${IDS:-}" ]; then grep "::" "$IDS" > "$out/ids.txt"  # e.g. the last call's unfinished.txt
  else "${PYTEST[@]}" --collect-only -q -m gpu tests/ ${expr:+-k "$expr"} 2>/dev/null | grep "::" > "$out/ids.txt"
  fi
  n=$(wc -l < "$out/ids.txt")
  # the tests marked bigmem (tests/conftest.py: 10-50 GB each) run one at a time in a shard of
  # their own beside the others: two of them at once ran an 80 GB card out of memory
  "${PYTEST[@]}" --collect-only -q -m "gpu and bigmem" tests/ 2>/dev/null | grep "::" \
    | grep -xFf - "$out/ids.txt" > "$out/ids_big.txt"
  grep -vxFf "$out/ids_big.txt" "$out/ids.txt" > "$out/ids_rest.txt"
  echo "$n GPU tests in $shards shards and one of $(wc -l < "$out/ids_big.txt") bigmem tests"
  if [ "$n" -eq 0 ]; then echo "no GPU test collected"; failures=$((failures + 1)); return; fi
  for i in $(seq 0 $((shards - 1))) big; do
    if [ "$i" != big ]; then
      awk -v n="$shards" -v i="$i" 'NR % n == i' "$out/ids_rest.txt" > "$out/ids_$i.txt"
    fi
    [ -s "$out/ids_$i.txt" ] || continue
    # shellcheck disable=SC2046
    step "shard_$i" "${TEST_SECS:-540}" "${PYTEST[@]}" -v -rfEs -m gpu -o timeout=150 \
      $(cat "$out/ids_$i.txt") > "$out/shard_$i.line" &
  done
  wait
  cat "$out"/shard_*.line
  # each shard counted in its own subshell: count again from their lines
  failures=$((failures + $(grep -h "^shard_" "$out"/shard_*.line | grep -vc "rc=0 ")))
  echo "alltests: $(cat "$out"/shard_*.log | grep -cE " PASSED") passed, $(cat "$out"/shard_*.log \
    | grep -cE " (FAILED|ERROR)") failed, $(cat "$out"/shard_*.log | grep -cE " SKIPPED") skipped of $n"
  rerun_out_of_memory
  list_unfinished
  rm -f "$out"/ids_*.txt "$out"/shard_*.line
}

list_unfinished() {
  # A shard killed at $TEST_SECS leaves tests that never ran (and, without its summary, failures
  # the OOM rerun cannot see): every test of a killed shard that did not pass or skip goes to
  # $out/unfinished.txt, for the next call: IDS=unfinished.txt gpu_check.sh alltests
  local shard
  : > "$out/unfinished.txt"
  for shard in $(grep -l "rc=137 " "$out"/shard_*.line 2>/dev/null); do
    shard="${shard%.line}"
    grep -oE "^tests/[^ ]+ (PASSED|SKIPPED)" "$shard.log" | cut -d" " -f1 | sort -u > "$shard.done"
    grep -vxFf "$shard.done" "${shard/shard_/ids_}.txt" >> "$out/unfinished.txt"
    rm -f "$shard.done"
  done
  [ -s "$out/unfinished.txt" ] || { rm -f "$out/unfinished.txt"; return 0; }
  echo "unfinished in killed shards: $(wc -l < "$out/unfinished.txt") tests, listed in unfinished.txt"
}

rerun_out_of_memory() {
  # The reduced-shape gradient tests hold ~30 GB each (autograd on the fp32 reference): two at
  # once beside the other shards run an 80 GB card out of memory (8 such failures on the H100,
  # 2026-12-06, each passing alone). Shards whose log shows an OutOfMemoryError get their
  # failed tests run once more, one process, after the others; reported as a step of its own
  # and counted only by that step.
  local logs="" ids shard
  for shard in $(grep -l "rc=1 " "$out"/shard_*.line 2>/dev/null); do  # failed, not killed
    shard="${shard%.line}.log"
    grep -q "OutOfMemoryError" "$shard" && logs="$logs $shard"
  done
  [ -n "$logs" ] || return 0
  # shellcheck disable=SC2086
  ids=$(grep -hE "^(FAILED|ERROR) " $logs | sed -E 's/^(FAILED|ERROR) ([^ ]+).*/\2/' | sort -u)
  [ -n "$ids" ] || return 0
  failures=$((failures - $(echo $logs | wc -w)))  # those shards' verdict moves to the rerun
  echo "rerun alone, out of memory in the shards: $(echo "$ids" | wc -l) tests"
  # shellcheck disable=SC2086
  step oom_rerun "${RERUN_SECS:-300}" "${PYTEST[@]}" -q -rfEs -m gpu -o timeout=300 $ids
}

run_bench() {
  step "bench_${1}" "${BENCH_SECS:-540}" python3 -m mok_cute.cli bench --shapes single \
    --contenders mok_cute,mok_megakernel,torch_grouped_mm,cublas_8192 --mok-config check_ids=False \
    --iters 20 --warmup 5 --rounds "${ROUNDS:-5}" --out "$out" --tag "$1" \
    && bench_rows_ok "$out/bench_${1}.log"
}

run_sonic() {
  # the warm-up times each shape once; a shape it finished stays in the cache if it is killed
  step sonic_warmup "${WARM_SECS:-540}" python3 -m mok_cute.cli bench --shapes "$SHAPES5" \
    --contenders sonicmoe --iters 1 --warmup 1 --out "$out/warmup" --tag sonic_warmup \
    --quack-cache "$QUACK_CACHE_DIR" || { echo "warm-up incomplete ($(du -sh "$QUACK_CACHE_DIR" \
    2>/dev/null | cut -f1) cached): call 'gpu_check.sh sonic' again within 30 s"; return; }
  step "sonic_${1}" "${BENCH_SECS:-540}" python3 -m mok_cute.cli bench --shapes single \
    --contenders mok_cute,torch_grouped_mm,sonicmoe,cublas_8192 --mok-config check_ids=False \
    --iters 20 --warmup 5 --rounds "${ROUNDS:-5}" --out "$out" --tag "$1" \
    --quack-cache "$QUACK_CACHE_DIR" && bench_rows_ok "$out/sonic_${1}.log"
}

run_fp8() {
  # FP8_TESTS=0: the bench alone (alltests already ran the FP8 tests, sharded)
  [ "${FP8_TESTS:-1}" = 0 ] || step fp8_tests 300 "${PYTEST[@]}" -q -rfEs -m gpu -o timeout=150 tests/test_fp8_path.py \
    tests/test_gemm_fp8.py tests/test_gemm_fp8_fc1.py tests/test_gemm_fp8_dgrad.py tests/test_gemm_fp8_wgrad.py tests/test_fp8_training.py \
    tests/test_quantize_kernels.py
  step "fp8_${1}" "${BENCH_SECS:-330}" python3 -m mok_cute.cli bench \
    --shapes "$SHAPES5" --contenders mok_cute,mok_cute_fp8,torch_grouped_mm,torch_scaled_grouped_mm,cublas_fp8_8192 \
    --mok-config check_ids=False --iters 20 --warmup 5 --rounds "${ROUNDS:-3}" --out "$out" \
    --tag "$1" && bench_rows_ok "$out/fp8_${1}.log"
}

run_fp8_train() {
  step "fp8train_${1}" "${BENCH_SECS:-420}" python3 -m mok_cute.cli bench --train --shapes "$SHAPES5" \
    --contenders mok_cute,mok_cute_fp8,torch_grouped_mm,torch_scaled_grouped_mm \
    --mok-config check_ids=False --iters 10 --warmup 3 --rounds "${ROUNDS:-2}" --out "$out" \
    --tag "fp8train_$1" && bench_rows_ok "$out/fp8train_${1}.log"
}

run_fp8_probes() {
  # where the FP8 time goes: forward stages (fused / unfused x, FC1 128 vs 256 + quantize_h),
  # the FP8 GEMMs at every tile width, the FP8 dgrads and weight gradients beside bf16
  step fp8_layer_profile 200 python3 tools/layer_profile.py --fp8 --shapes dsv3_ep8_rank,qwen3_30b \
    --json "$out/fp8_layer_profile.json" && grep -E "^  fp8|^  fc|^  layer" "$out/fp8_layer_profile.log"
  step fp8_gemm_probe 150 python3 tools/fp8_gemm_probe.py --json "$out/fp8_gemm_probe.json" \
    && cat "$out/fp8_gemm_probe.log"
  step fp8_backward_profile 200 python3 tools/backward_profile.py --fp8 --shapes dsv3_ep8_rank \
    --json "$out/fp8_backward_profile.json" && grep -E "fp8|wgrad|dgrad" "$out/fp8_backward_profile.log"
  step fp8_wgrad_tests 240 "${PYTEST[@]}" -q -rfEs -m gpu tests/test_gemm_fp8_wgrad.py \
    tests/test_quantize_kernels.py::test_quantize_cols_per_expert_kernel_is_bitwise_the_reference \
    tests/test_fp8_training.py -k "wgrad or per_expert or size_threshold"
  step fp8_wgrad_probe 300 python3 tools/fp8_wgrad_probe.py --layer --json "$out/fp8_wgrad_probe.json" \
    && grep -E "wgrad|quantize|layer" "$out/fp8_wgrad_probe.log"
}

run_mkbwd() {
  step mkbwd_tests 240 "${PYTEST[@]}" -q -rfEs -m gpu -o timeout=150 tests/test_megakernel_backward.py
  step mkbwd_probe 300 python3 tools/megakernel_backward_probe.py \
    --shapes "${1:-qwen3_30b,dsv3_ep8_rank,gptoss_120b,sonic_120b,mixtral}" --rounds 3 ${MKBWD_FLAGS:-} \
    --json "$out/megakernel_backward_probe.json" && grep -E "speed" "$out/mkbwd_probe.log"
}

run_stages() {
  if [ "${STAGES_TESTS:-0}" = 1 ]; then
    step stages_tests 240 "${PYTEST[@]}" -q -rfEs -m gpu -o timeout=150 \
      tests/test_megakernel_backward.py::test_megakernel_dgrads_equal_the_two_launches_bitwise \
      tests/test_backward.py
  fi
  step stages_probe 560 python3 tools/operand_stages_probe.py \
    --shapes "${1:-gptoss_120b,custom:4096,2048,768,128,8,custom:32768,2880,2880,128,4,dsv3_ep8_rank}" \
    --variants fit:8,3:8,2:8 --rounds 4 ${STAGES_FLAGS:-} --json "$out/operand_stages.json" \
    && grep -E "median|bitwise" "$out/stages_probe.log"
}

run_bwdtimeline() {
  step bwdtimeline_tests 300 "${PYTEST[@]}" -q -rfEs -m gpu -o timeout=200 \
    -k "recorder or config_timeline" tests/test_megakernel_backward.py tests/test_backward.py \
    tests/test_virtual_training.py
  local shape
  for shape in $(echo "${1:-qwen3_30b,dsv3_ep8_rank}" | tr ',' ' '); do
    step "bwdtimeline_$shape" 240 python3 -m mok_cute.cli timeline --backward --shape "$shape" \
      --out "$out/timeline_bwd_$shape" && tail -25 "$out/bwdtimeline_$shape.log"
  done
}

run_bwdgroup() {
  # one rank of 8 virtual ranks' group (peers' pushes and flags in place): the launch with its
  # comm CTAs and the group tail
  step bwdgroup 540 python3 tools/group_backward_probe.py --one-rank \
    --shapes "${1:-qwen3.5_397b}" --ranks 8 --tokens 2048 --rounds 1 --reps 1 \
    --timeline "$out/timeline_bwd_group" --json "$out/timeline_bwd_group.json" \
    && grep -E "timeline:" "$out/bwdgroup.log"
}

run_shared() {
  # the shared expert's backward inside the backward megakernel (nineteenth session): its GPU
  # tests first, then its timings against its launches (group_backward_probe)
  step shared_tests 420 "${PYTEST[@]}" -q -rfEs -m gpu -o timeout=200 -k "shared" \
    tests/test_megakernel_backward.py tests/test_group_backward.py tests/test_virtual_training.py
  step shared_virtual 300 python3 tools/group_backward_probe.py --virtual-only \
    --shapes "${1:-qwen3.5_397b,glm_5.2}" --ranks 8 --tokens 2048 --rounds 3 --reps 3 \
    --precision bf16,fp8 --json "$out/shared_virtual.json"
  step shared_one_rank 300 python3 tools/group_backward_probe.py --one-rank \
    --shapes "${1:-qwen3.5_397b,glm_5.2}" --ranks 8 --tokens 2048 --rounds 3 --reps 3 \
    --comm-ctas 16 --json "$out/shared_one_rank.json"
}

run_maingrad() {
  # the weight gradients added into fp32 main_grad (twentieth session): the GPU tests, then the
  # fused backward against bf16 gradients + main_grad.add_ (tools/main_grad_probe.py)
  step maingrad_tests 420 "${PYTEST[@]}" -q -rfEs -m gpu -o timeout=200 -k "main_grad" \
    tests/test_main_grad.py tests/test_megakernel_backward.py
  step maingrad_probe 420 python3 tools/main_grad_probe.py \
    --shapes "${1:-dsv3_ep8_rank,qwen3_30b,sonic_120b,mixtral,gptoss_120b}" --rounds 3 \
    --json "$out/main_grad_probe.json" ${MAINGRAD_MODES:+--modes "$MAINGRAD_MODES"}
}

run_vtrain() {
  step "vtrain_${1}" "${BENCH_SECS:-540}" python3 -m mok_cute.cli bench --train \
    --shapes "${VTRAIN_SHAPES:-qwen3.5_397b,glm_5.2,kimi_k2.7,dsv4_pro}" \
    --contenders mok_megakernel,mok_virtual --mok-config check_ids=False --iters 5 --warmup 2 \
    --rounds "${ROUNDS:-2}" --out "$out" --tag "vtrain_$1" && bench_rows_ok "$out/vtrain_${1}.log"
}

run_train() {
  step "train_${1}" "${BENCH_SECS:-330}" python3 -m mok_cute.cli bench --train --shapes single \
    --mok-config check_ids=False --iters 10 --warmup 3 --rounds "${ROUNDS:-3}" --out "$out" \
    --tag "$1" && bench_rows_ok "$out/train_${1}.log"
  # the tests compile on their own cores while the example trains (its step times: indicative)
  step train_tests 200 "${PYTEST[@]}" -q -rfEs -m gpu -o timeout=150 tests/test_backward.py \
    tests/test_benchmark.py -k "compiled or training" > "$out/train_tests.line" &
  step train_tiny_moe 200 python3 examples/train_tiny_moe.py --steps "${STEPS:-300}" --out "$out"
  tail -4 "$out/train_tiny_moe.log"
  wait
  cat "$out/train_tests.line"
  grep -q "^train_tests *rc=0 " "$out/train_tests.line" || failures=$((failures + 1))
}

run_ncu() {
  # where a path's time goes (thirty-fourth session: the FP8 megakernel against its launches)
  local ncu shape metrics="" m field config=()
  for field in ${NCU_CONFIG:-precision=fp8}; do config+=(--mok-config "$field"); done
  [ "${NCU_BACKWARD:-0}" = 1 ] && config=(--backward)
  ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
  [ -n "$ncu" ] || { echo "no ncu on this machine"; failures=$((failures + 1)); return; }
  "$ncu" --query-metrics --chip gh100 > "$out/ncu_metrics.txt" 2>&1
  for m in dram__bytes_read.sum dram__bytes_write.sum lts__t_bytes.sum lts__t_sector_hit_rate.pct \
      lts__t_sectors_srcunit_tex_op_read.sum lts__t_sectors_srcunit_tex_op_write.sum \
      lts__t_requests_srcunit_tex.sum smsp__inst_executed.sum gpu__time_duration.sum \
      sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed; do
    if grep -qE "^\s*${m%%.*}\b" "$out/ncu_metrics.txt"; then metrics="$metrics,$m"; else echo "ncu lacks $m"; fi
  done
  rm -f "$out/ncu_metrics.txt"
  for shape in ${1//,/ }; do
    step "ncu_source_$shape" 200 "$ncu" --profile-from-start off --clock-control none \
      --kernel-name "regex:Megakernel|Gemm" --section SourceCounters --section SpeedOfLight \
      -f -o "$out/src_$shape" python3 tools/ncu_layer.py --shapes "$shape" \
      "${config[@]}"
    if [ -f "$out/src_$shape.ncu-rep" ]; then
      "$ncu" -i "$out/src_$shape.ncu-rep" --page source --print-source sass --csv \
        > "$out/ncu_source_$shape.csv" 2>/dev/null
      "$ncu" -i "$out/src_$shape.ncu-rep" --page details --csv > "$out/ncu_details_$shape.csv" 2>/dev/null
      rm -f "$out/src_$shape.ncu-rep"
      python3 tools/ncu_source_summary.py "$out/ncu_source_$shape.csv" --top 8 | cut -c1-200
      python3 -c 'import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    if r["Metric Name"] in ("Duration", "SM Frequency", "Compute (SM) Throughput",
                            "L2 Cache Throughput", "DRAM Throughput"):
        print(r["Kernel Name"][40:80], r["Metric Name"], r["Metric Value"], r["Metric Unit"])' \
        "$out/ncu_details_$shape.csv"
      rm -f "$out/ncu_details_$shape.csv"  # printed above; a call brings back at most 8 files
    fi
    step "ncu_counters_$shape" 200 "$ncu" --profile-from-start off --clock-control none --csv \
      --metrics "${metrics#,}" --log-file "$out/ncu_counters_$shape.csv" \
      python3 tools/ncu_layer.py --shapes "$shape" "${config[@]}" \
      && python3 tools/ncu_summary.py --per-launch "$out/ncu_counters_$shape.csv" \
        | grep -E "^  (\[|#[0-9]+ [A-Z])" | cut -c1-400
    gzip -f "$out"/ncu_*_"$shape".csv 2>/dev/null
  done
}

run_sanitize() {
  # torch probes driver symbols at start-up: harmless API errors, not reported (--report-api-errors no)
  local tool
  for tool in memcheck racecheck synccheck; do
    step "sanitize_$tool" "${SANITIZE_SECS:-540}" compute-sanitizer --tool "$tool" \
      --report-api-errors no --error-exitcode 3 python3 tools/sanitize.py > "$out/sanitize_$tool.line" &
  done
  wait
  for tool in memcheck racecheck synccheck; do
    cat "$out/sanitize_$tool.line"
    grep -E "cases ok|ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitize_$tool.log" | tail -2 | cut -c1-150
    grep -q "rc=0 " "$out/sanitize_$tool.line" || failures=$((failures + 1))
  done
}

run_ep() {
  local n="${1:-$(nvidia-smi -L | wc -l)}" parts=",${2:-check,example,bench,train}," part
  if ! [[ "$n" =~ ^[0-9]+$ ]]; then
    echo "ep: N (the GPU count) comes first, got '$n': ep [N] [PARTS]"; failures=$((failures + 1)); return
  fi
  for part in $(echo "$parts" | tr ',' ' '); do
    case "$part" in check|example|bench|train) ;;
      *) echo "ep: unknown part '$part' (check, example, bench, train)"; failures=$((failures + 1)); return ;;
    esac
  done
  if [ "$n" -lt 2 ]; then echo "ep: needs 2 or more GPUs, this machine has $n"; failures=$((failures + 1)); return; fi
  local run=(torchrun --nproc-per-node "$n")
  if [[ "$parts" == *,check,* ]]; then
    step "ep_check_$n" 240 "${run[@]}" tools/ep_check.py --backend megakernel
    step "ep_check_kimi_$n" 240 "${run[@]}" tools/ep_check.py --backend megakernel --shape kimi --tokens 1024
  fi
  if [[ "$parts" == *,example,* ]]; then
    step "ep_example_$n" 240 "${run[@]}" examples/ep_torchrun.py --shape kimi --tokens 2048 --backend megakernel \
      --train 2 --timeline "$out/timeline_ep$n" && grep -E "^timeline:" "$out/ep_example_$n.log"
    # FP8 over IPC: the forward checked against the bf16 reference, then training steps
    step "ep_example_fp8_$n" 300 "${run[@]}" examples/ep_torchrun.py --shape glm --tokens 2048 \
      --backend megakernel --precision fp8 --train 5
  fi
  if [[ "$parts" == *,bench,* ]]; then
    step "ep_bench_$n" 300 "${run[@]}" -m mok_cute.cli bench --ep --shapes ep --tokens 2048 \
      --mok-config backend=megakernel --out "$out" --tag "ep$n" && bench_rows_ok "$out/ep_bench_$n.log"
  fi
  if [[ "$parts" == *,train,* ]]; then
    # training over the group: the IPC megakernel's saving launch + group_backward against
    # all_to_all + torch._grouped_mm under autograd (gradients checked first)
    step "ep_train_$n" 400 "${run[@]}" -m mok_cute.cli bench --ep --train --contenders mok_cute,nccl_torch \
      --shapes ep --tokens 2048 --iters 10 --warmup 2 --mok-config backend=megakernel --out "$out" \
      --tag "ep${n}_train" && bench_rows_ok "$out/ep_train_$n.log"
  fi
}

case "$mode" in
  tests) run_tests ;;
  alltests) run_alltests "${2:-}" ;;
  bench) run_bench "${2:-single}" ;;
  sonic) run_sonic "${2:-vs_sonicmoe}" ;;
  train) run_train "${2:-train}" ;;
  vtrain) run_vtrain "${2:-r8}" ;;
  fp8) run_fp8 "${2:-fp8}" ;;
  fp8train) run_fp8_train "${2:-fp8}" ;;
  fp8probe) run_fp8_probes ;;
  mkbwd) run_mkbwd "${2:-}" ;;
  stages) run_stages "${2:-}" ;;
  shared) run_shared "${2:-}" ;;
  bwdtimeline) run_bwdtimeline "${2:-}" ;;
  bwdgroup) run_bwdgroup "${2:-}" ;;
  maingrad) run_maingrad "${2:-}" ;;
  sanitize) run_sanitize ;;
  ncu) run_ncu "${2:-qwen3_30b,gptoss_120b}" ;;
  ep) run_ep "${2:-}" "${3:-}" ;;
  *) echo "gpu_check.sh: unknown mode '$mode' (tests, alltests, bench, sonic, train, vtrain, fp8, fp8train, fp8probe, mkbwd, stages, bwdtimeline, bwdgroup, shared, maingrad, sanitize, ncu, ep)" >&2; exit 2 ;;
esac
echo "$mode: $failures failed step(s)"
[ "$failures" -eq 0 ]
