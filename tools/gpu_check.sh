#!/usr/bin/env bash
# One call on the GPU host that checks everything GPU-side, each step under its own time limit
# so a hung kernel costs minutes, not the whole lease. Logs and JSON go to $OUT (or ./out).
#
#   source .gpu/prelude.sh && bash tools/gpu_check.sh MODE [N]   (modes below)
#
#   tests  pytest -m gpu, file by file, 120 s per test (pytest-timeout), 300 s per file
#   bench  mok-cute bench on the five single-GPU shapes: mok_cute (default and check_ids=False),
#          the recorder, the megakernel at R = 1 (check_ids=False), the torch pipeline, cuBLAS; plus a recorded dsv3 timeline
#   sonic  the same bench with SonicMoE on dsv3_ep8_rank and sonic_120b (2-3 min autotune each),
#          with the megakernel at R = 1 beside it
#   sonicwarm [SHAPES]  compile and autotune SonicMoE into ./.quack_cache (kept while the machine
#          stays warm), each shape timed; then, within 30 s:
#   sonicall [TAG]  the bench of record on all five one-GPU shapes: mok_cute, torch, SonicMoE, cuBLAS
#   sonicsustained  after sonicwarm: mok_cute's layer against SonicMoE, each sustained for 2 s at
#          the power cap (tools/cap_ceiling_probe.py --variants layer,sonicmoe)
#   mega   the megakernel: its GPU tests, then tools/megakernel_probe.py (comm-CTA sweep, bitwise
#          against the expert path, one recorded timeline) and moe_forward_virtual at R = 8
#          against R = 1 on MoK's four shapes
#   gemm   the pingpong GEMM's GPU tests (with gemm_sm90.FIRST_MMA_OVERWRITES on and off), then
#          tools/gemm_probe.py: cooperative 256 against pingpong 128 with and without the
#          first-k-block overwrite, FC1 and FC2 of qwen3, gptoss and dsv3
#   schedule  the GPU build of the one-rank schedule: its GPU tests (bitwise against the torch
#          build), then tools/schedule_probe.py (build times, layer with schedule.GPU_BUILD off/on)
#   virtual  virtual R = 8 against R = 1 (kimi, glm), the 8 schedules batched or not
#          (MOK_BATCHED_SCHEDULE)
#   qwen3comm  recorded megakernel calls on qwen3_30b at 2 and 4 comm CTAs (why 2 is 1.6x slower)
#   order  the megakernel's GPU tests, then tools/megakernel_probe.py at R = 1 on the five
#          single-GPU shapes: the list with and without its no-op comm tasks, 1 and 2 comm
#          CTAs, the auto FC1 lead, N-tile-major minibatches (2 alternating rounds)
#   glue   tools/layer_profile.py on mixtral, dsv3, qwen3 (stage by stage), then mixtral's GEMMs
#          by group_m (tools/gemm_probe.py)
#   tickets dynamic compute tickets (DYNAMIC_TICKETS): GPU tests, virtual R = 8 and R = 1 on
#          dsv4_pro, kimi, glm, qwen3.5, static against dynamic, then R = 1 on dsv3, mixtral, qwen3
#   leadr8 recorded virtual R = 8 calls of dsv4_pro with the FC1 lead on and off
#   epdyn N  on an N-GPU machine: mok-cute bench --ep with static, then dynamic compute tickets
#   ep N   on an N-GPU machine: tools/ep_check.py (reference, determinism, comm split, emulated
#          == real), the IPC megakernel under torchrun (examples/ep_torchrun.py --backend
#          megakernel), then mok-cute bench --ep
#   why    recorded mixtral (expert path, megakernel) and qwen3.5 (R = 1, virtual R = 8) calls
#   ksum   one against two comm CTAs at one rank, 8 against 16 KSUM vectors per lane (KSUM_VECTORS)
#   virtualbench [TAG]  the virtual R = 8 bench of record
#   virtualrecord  qwen3.5 recorded at virtual R = 8 and at R = 1 on the same tokens
#   virtualcomm   virtual R = 8 at 12 / 16 / 20 / 24 comm CTAs (qwen3.5, glm, kimi)
#   final [VTAG STAG]  the megakernel's GPU tests, the virtual and the one-GPU benches of record
#   singlebench [TAG]  the one-GPU bench of record: mok_cute, the megakernel, torch, cuBLAS
#   megatests  the megakernel's GPU tests but the switches' (~6 min; with switchtests and rowstests,
#          every megakernel GPU test: together they outgrew one call in run 92)
#   experttests  the expert path's GPU tests (moe_forward, token ops) with its defaults
#   qwen35comm  qwen3.5 at virtual R = 8 with 14, 16 and 18 comm CTAs (3 alternating rounds)
#   cluster  the cooperative GEMMs in clusters of two CTAs multicasting B (GEMM_CLUSTER_M):
#          GPU tests, tools/gemm_probe.py plain against cluster, the layer bench with each (~8 min)
#   clusterab  clusters of two against one, interleaved rounds: the GEMMs alone, then the layer (~4 min)
#   testbench [TAG]  the expert path's, token ops' and GEMM's GPU tests, then the one-GPU
#          bench of record (~6 min; run 76 as `clusteron`)
#   flatcopy  the comm CTAs' flat row copy (COMM_COPY_VECTORS): GPU tests, then qwen3.5 and glm
#          at virtual R = 8 with 16 / 24 vectors per lane and fewer comm CTAs (~8 min)
#   decoded  decoded task words through the ticket ring (DECODED_TICKETS): GPU tests, then the
#          megakernel at R = 1 on the five shapes (6 alternating rounds, with the expert path
#          and its GEMM clusters) (~7 min)
#   decodedvirtual  the same switch at virtual R = 8 and R = 1: qwen3.5, glm (~6 min)
#   switchtests  the GPU tests of STORE_WARP_SIGNALS, KSUM_STAGED, PINGPONG (~5 min; run 89)
#   switchprobe  (run 90) those three against the default of then, 8 interleaved rounds on the
#          five shapes, then qwen3.5 at virtual R = 8 with PINGPONG and KSUM_STAGED (~8 min)
#   rowstests  the megakernel GPU tests of KSUM_ROWS and ONE_EPILOGUE_BARRIER (~3 min; with
#          megatests and switchtests, every megakernel GPU test)
#   ksumrowsvirtual [TAG]  (run 98) 8-token KSUM tasks at virtual R = 8, then the one-GPU
#          bench of record (~3 min)
#   onebarrier  (run 101) ONE_EPILOGUE_BARRIER on both paths, 6 interleaved rounds on the five
#          shapes, then its GPU tests (~3 min)
#   shortstart  (run 102) SHORT_TASK_START: its GPU tests, 8 interleaved rounds on the five
#          shapes, dsv3 and gptoss recorded with it off and on (STAGE_WAIT spans) (~4 min)
#   fenceprobe  FENCE_FC1_ONLY: 6 interleaved rounds of the default and FC1's stages fenced only
#          (its GPU tests: run 109) (~7 min)
#   zerocomm  (runs 104-107) no comm CTA at one rank (num_comm_sms=0, the BARRIER on a compute CTA): its GPU
#          tests, then 8 interleaved rounds on the five shapes against one comm CTA (~5 min)
#   gaprecord  dsv3, gptoss and mixtral recorded on both paths, summaries only (~3 min)
#   tailrecord  the recorder's GPU test, then mixtral and qwen3 recorded on both paths, the raw
#          buffers kept (~4 min)
#   deferprobe  DEFER_SIGNALS (unmeasured): its GPU tests and the recorder's, then 6 interleaved
#          rounds against the default (~9 min on a fresh machine: the probe compiles per shape)
#   ncu        Nsight Compute counters (DRAM and L2 bytes, L2 hit rate, instructions, tensor
#          pipe, clock) of one call of each path, mixtral and qwen3, summed per path (~6 min)
#   ncusource  Nsight Compute's per-SASS-instruction counters (instructions executed, warp stall
#          samples) of the megakernel and the expert path's GEMMs, mixtral and qwen3 (NCU_SHAPES
#          overrides), summarized by tools/ncu_source_summary.py (~1 min a shape)
#   ncusourcering  the same for the megakernel alone with LOCAL_DIRECT off (FC1's A by TMA from
#          the ring, filled by comm CTAs), against the gathered A (~2 min)
#   onebatch   the megakernel with one minibatch holding every row (all FC1 tiles queued before
#          all FC2 tiles, as the expert path runs them) against the default 8-tile minibatches,
#          qwen3 and mixtral, 4 interleaved rounds (~4 min)
#   ncuring    the ncu counters of the megakernel alone with LOCAL_DIRECT off (~2 min)
#   releaseprobe  RELEASE_ONLY_PUBLISH: its GPU tests, then 6 interleaved rounds of the default,
#          DEFER_SIGNALS, it, and both (~5 min)
#   deferclock  DEFER_SIGNALS sustained: qwen3, dsv3, gptoss under the clock probe (~3 min)
#   warp0probe  WARP0_TMA_STAGES: its GPU tests, 6 interleaved rounds against the default, then the
#          clock probe with it (~7 min)
#   clockprobe  SM clock and power under nvidia-smi while each path runs for 2 s (~3 min)
#   wideprobe  the 128 x 64 epilogue subtiles (ops.EPILOGUE_N, megakernel.WIDE_EPILOGUE): their
#          GPU tests and the recorder's, then 6 interleaved rounds of both paths with and without
#          them (PROBE_SHAPES, PROBE_ROUNDS, PROBE_SECS override; ~8 min on a fresh machine)
#   switchrecord  RECORD_SWITCH off and on, RECORD_SHAPES (qwen3_30b) recorded on the megakernel
#   flushprobe  DEFER_FLUSH_KTILES: the deferred publish's GPU tests, then 6 interleaved rounds of
#          the default, DEFER_SIGNALS flushed after 1, 4 and 8 k-tiles (~8 min)
#   directprobe  FC1's A rows gathered from x by the producer (LOCAL_DIRECT, the default) against
#          rows dispatched into the ring by 1, 2 and 4 comm CTAs and loaded by TMA, interleaved
#          rounds at one rank (PROBE_SHAPES, PROBE_ROUNDS, PROBE_SECS)
#   ticketclock  static against dynamic tickets sustained (2 s per path, 4 alternating rounds,
#          SM clock and power): static tickets cut mixtral's L2 read sectors by a fifth (run 142)
#   stridedprobe  STRIDED_TICKETS: its GPU tests (10, sharded), then sustained against the
#          default with the SM clock (clock_probe, 4 rounds, PROBE_SHAPES) (~6 min)
#   strideddefault [TAG]  with STRIDED_TICKETS the one-rank default: every megakernel GPU test
#          (sharded), then the one-GPU bench of record (~8 min)
#   alltests  every GPU test (TEST_EXPR: a -k expression) in TEST_SHARDS (12) pytest processes at
#          once, under TEST_SECS (540): the compiles run in parallel on the host's 16 cores
#   ncul2 [KERNEL_REGEX [ncu_layer.py args]]  the ncu run with L2's sectors split by operation (read, write, atomic, reduction) and
#          by source (the SMs, the other L2 partition), for where the megakernel's extra L2
#          bytes come from (NCU_SHAPES; ~2 min a shape)
set -u
L2_METRICS="lts__t_bytes.sum lts__t_sectors.sum lts__t_sectors_op_read.sum lts__t_sectors_op_write.sum
  lts__t_sectors_op_atom.sum lts__t_sectors_op_red.sum lts__t_sectors_srcunit_tex.sum
  lts__t_sectors_srcunit_ltcfabric.sum lts__t_sectors_srcunit_tex_op_read.sum
  lts__t_sectors_srcunit_tex_op_write.sum lts__t_requests_srcunit_tex.sum
  lts__t_sectors_srcunit_tex_lookup_miss.sum lts__t_sectors_srcunit_tex_lookup_hit.sum
  dram__bytes_read.sum l1tex__t_bytes.sum gpu__time_duration.sum"
# megatests2: the megakernel GPU tests that megatests leaves to a second call
MEGA_SECOND="defer_signals or defer_flush or wide_epilogue or release_only_publish or warp0 or x_read_in_place or one_gpu_megakernel or silent_peer or out_of_range or recorded_megakernel_timeline"
out="${OUT:-out}"
mkdir -p "$out"
what="${1:-tests}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

gpu_tests_passed() {
  # gpu_tests_passed NAME "-k expression" SECONDS [FILES...]: the GPU tests of FILES (default
  # the megakernel's) matching the expression, one line of result; fails unless some passed
  # and none failed
  local name="$1" expr="$2" secs="$3"
  shift 3
  [ $# -gt 0 ] || set -- tests/test_megakernel.py
  timeout -s KILL "$secs" python3 -m pytest -v -m gpu -p no:cacheprovider -W ignore -o timeout=90 \
    --tb=short "$@" -k "$expr" > "$out/test_$name.log" 2>&1
  echo "$name tests rc=$?: $(grep -E "passed|failed" "$out/test_$name.log" | tail -1)"
  grep -E "^FAILED|Error" "$out/test_$name.log" | head -5
  grep -q " passed" "$out/test_$name.log" && ! grep -q "failed" "$out/test_$name.log"
}

gpu_tests_sharded() {
  # gpu_tests_sharded NAME "-k expression" SECONDS SHARDS [FILES...]: the GPU tests of FILES
  # (default: every test file) matching the expression, split round-robin over SHARDS pytest
  # processes on the one GPU. The compiles (one CPU core each) are most of a test's time, so
  # SHARDS processes run them SHARDS times faster; their kernels share the GPU by time slices,
  # each launch still co-resident in its own context. One log per shard, one summary line.
  local name="$1" expr="$2" secs="$3" shards="$4"
  shift 4
  [ $# -gt 0 ] || set -- tests/
  python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider "$@" -k "$expr" 2>/dev/null \
    | grep "::" > "$out/ids_$name.txt"
  echo "$name: $(wc -l < "$out/ids_$name.txt") tests in $shards shards"
  local i
  for i in $(seq 0 $((shards - 1))); do
    awk -v n="$shards" -v i="$i" 'NR % n == i' "$out/ids_$name.txt" > "$out/ids_${name}_$i.txt"
    # shellcheck disable=SC2046
    timeout -s KILL "$secs" python3 -m pytest -v -rs -m gpu -p no:cacheprovider -W ignore \
      -o timeout=150 --tb=short $(cat "$out/ids_${name}_$i.txt") > "$out/test_${name}_$i.log" 2>&1 &
  done
  wait
  local passed failed skipped
  passed=$(cat "$out"/test_"${name}"_*.log | grep -cE " PASSED")
  failed=$(cat "$out"/test_"${name}"_*.log | grep -cE " FAILED| ERROR")
  skipped=$(cat "$out"/test_"${name}"_*.log | grep -cE " SKIPPED")
  echo "$name tests: $passed passed, $failed failed, $skipped skipped of $(wc -l < "$out/ids_$name.txt")"
  cat "$out"/test_"${name}"_*.log | grep -E "^FAILED|^ERROR|^SKIPPED" | cut -c1-200 | head -12
  # one log back (a call returns at most 8 files)
  cat "$out"/test_"${name}"_*.log > "$out/test_$name.log"
  rm -f "$out"/test_"${name}"_*.log "$out"/ids_"${name}"_*.txt
  [ "$passed" -gt 0 ] && [ "$failed" -eq 0 ]
}

record_summary() {
  # record_summary SECONDS DIR PATTERN [TIMELINE ARGS...]: one recorded call (mok-cute timeline
  # --out DIR ...), its printed lines matching PATTERN; the trace and the PNG are dropped (the
  # summary and the raw buffer stay in DIR)
  local secs="$1" dir="$2" pattern="$3"
  shift 3
  timeout -s KILL "$secs" python3 -m mok_cute.cli timeline --out "$dir" "$@" 2>&1 \
    | grep -E "$pattern" | tail -10
  rm -f "$dir/timeline_trace.json" "$dir/timeline.png"
}

layer_probe() {
  # layer_probe SECONDS NAME PROBE ARGS...: tools/megakernel_probe.py at R = 1 on the five
  # single-GPU shapes (or PROBE_SHAPES) with the given --comm / --rounds / expert-path flags;
  # JSON to $out/NAME.json
  local secs="$1" name="$2"
  shift 2
  timeout -s KILL "$secs" python3 tools/megakernel_probe.py \
    --shapes "${PROBE_SHAPES:-qwen3_30b,mixtral,dsv3_ep8_rank,gptoss_120b,sonic_120b}" "$@" \
    --json "$out/$name.json" 2>&1 \
    | grep -v Warn | sed -E "s/'ms_rounds': \[[^]]*\], //" | cut -c1-200 | tail -40
}

switch_clock_probe() {
  # switch_clock_probe SECONDS SHAPES SWITCH ROUNDS NAME: tools/clock_probe.py, sustained (2 s
  # per variant) with the SM clock: the expert path, the megakernel and the megakernel with
  # the boolean SWITCH flipped, ROUNDS alternating rounds; JSON to $out/NAME.json
  timeout -s KILL "$1" python3 tools/clock_probe.py --shapes "$2" --rounds "$4" --switch "$3" \
    --json "$out/$5.json" 2>&1 | grep -v Warn | tail -60
}

virtual_probe() {
  # virtual_probe SECONDS SHAPES SPECS NAME: tools/megakernel_probe.py at virtual R = 8 against
  # R = 1 (3 alternating rounds), one --virtual-comm spec per variant; JSON to $out/NAME.json
  timeout -s KILL "$1" python3 -u tools/megakernel_probe.py --shapes "" --virtual "$2" \
    --virtual-comm "$3" --virtual-rounds 3 --out "$out" --json "$out/$4.json" 2>&1 | grep -v Warn \
    | sed -E "s/'ms_rounds': \[[^]]*\], //" | cut -c1-220
}

run_tests() {
  local t0=$SECONDS
  for f in $(grep -lE "mark\.gpu" tests/test_*.py); do  # files with GPU tests only
    name=$(basename "$f" .py)
    timeout -s KILL 300 python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore \
      -o timeout=120 --tb=short "$f" > "$out/$name.log" 2>&1
    rc=$?
    summary=$(grep -E "passed|failed|skipped|deselected|error" "$out/$name.log" | tail -1)
    printf '%-32s rc=%-3s %s\n' "$name" "$rc" "${summary:-killed (no summary: see $name.log)}"
  done
  echo "tests took $((SECONDS - t0)) s"
}

run_bench() {
  timeout -s KILL 240 python3 -m mok_cute.cli bench --shapes single \
    --contenders mok_cute,mok_cute_timeline,torch_grouped_mm,cublas_8192 \
    --iters 20 --warmup 5 --rounds 3 --out "$out" --tag expert_kernels 2>&1 | tail -20
  timeout -s KILL 240 python3 -m mok_cute.cli bench --shapes single \
    --contenders mok_cute,mok_megakernel,torch_grouped_mm,cublas_8192 --mok-config check_ids=False \
    --iters 20 --warmup 5 --rounds 3 --out "$out" --tag expert_kernels_nocheck 2>&1 | tail -18
  timeout -s KILL 60 python3 -m mok_cute.cli timeline --shape dsv3_ep8_rank --t-scale 0.5 \
    --out "$out/timeline" 2>&1 | tail -12
}

run_sonic() {
  # run_sonic TAG: the SonicMoE bench of record (tag: the results file's name)
  timeout -s KILL 560 python3 -m mok_cute.cli bench --shapes dsv3_ep8_rank,sonic_120b \
    --contenders mok_cute,mok_megakernel,mok_cute_timeline,torch_grouped_mm,sonicmoe,cublas_8192 \
    --mok-config check_ids=False --iters 20 --warmup 5 --rounds 7 --out "$out" --tag "$1" \
    --quack-cache /tmp/quack_cache 2>&1 | tail -16  # SonicMoE's kernel cache stays out of $OUT
}

run_mega() {
  timeout -s KILL 240 python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore -o timeout=60 \
    --tb=short tests/test_megakernel.py tests/test_sync.py tests/test_gemm_sm90.py -k "megakernel or sync or gather or peer or ring or local" \
    > "$out/test_megakernel.log" 2>&1; tail -30 "$out/test_megakernel.log" | grep -E "FAILED|Error|passed|failed" | tail -12
  timeout -s KILL 240 python3 -u tools/megakernel_probe.py --shapes dsv3_ep8_rank,sonic_120b \
    --comm 2l,2lf,2lfx,4lf --timeline 2lf --out "$out" --json "$out/megakernel_probe.json" 2>&1 | grep -v Warn | tail -16
  timeout -s KILL 90 python3 -m mok_cute.cli timeline --shape dsv3_ep8_rank --mok-config backend=megakernel \
    --out "$out/megakernel_timeline" 2>&1 | tail -8
  timeout -s KILL 120 python3 -m mok_cute.cli timeline --shape kimi_k2.7 --ranks 8 --capacity 262144 \
    --mok-config check_ids=False --out "$out/virtual_r8_timeline" 2>&1 | grep -E "busy|wait|idle|GB/s|TFLOP|exposed|tasks" | tail -10
  timeout -s KILL 200 python3 -m mok_cute.cli bench --shapes kimi_k2.7,glm_5.2,qwen3.5_397b,dsv4_pro \
    --ep-ranks 8 --contenders mok_megakernel,mok_cute_virtual,cublas_8192 --mok-config check_ids=False \
    --iters 10 --warmup 3 --out "$out" --tag virtual_r8 2>&1 | tail -14
}

run_gemm() {
  timeout -s KILL 120 python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore \
    -o timeout=60 --tb=short tests/test_gemm_sm90.py -k "pingpong or True" > "$out/test_pingpong.log" 2>&1
  echo "pingpong tests rc=$?: $(grep -E "passed|failed" "$out/test_pingpong.log" | tail -1)"
  timeout -s KILL 180 python3 -u tools/gemm_probe.py --shapes qwen3_30b,gptoss_120b,dsv3_ep8_rank \
    --variants 256:8,128p:8,128po:8,128p:8 --json "$out/gemm_probe.json" 2>&1 | grep -v Warn | grep mok
}

run_schedule() {
  timeout -s KILL 150 python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore -o timeout=60 \
    --tb=short tests/test_schedule_build.py > "$out/test_schedule_build.log" 2>&1
  echo "schedule_build tests rc=$?: $(grep -E "passed|failed" "$out/test_schedule_build.log" | tail -1)"
  grep -E "^FAILED|Error" "$out/test_schedule_build.log" | head -5
  timeout -s KILL 360 python3 -u tools/schedule_probe.py --shapes dsv3_ep8_rank,sonic_120b \
    --json "$out/schedule_probe.json" 2>&1 | grep -v Warn | tail -8
}

run_virtual() {
  # virtual R = 8 against R = 1 with the schedules of all 8 ranks from one pair of launches
  # (MOK_BATCHED_SCHEDULE=1) or one pair per rank (0), same call, alternating rounds inside each
  for b in 0 1; do
    MOK_BATCHED_SCHEDULE=$b timeout -s KILL 200 python3 -m mok_cute.cli bench --shapes kimi_k2.7,glm_5.2 \
      --ep-ranks 8 --contenders mok_megakernel,mok_cute_virtual --mok-config check_ids=False \
      --iters 10 --warmup 3 --rounds 3 --out "$out/batched$b" --tag virtual_r8_batched$b 2>&1 | grep "│ [a-z]"
  done
}

run_qwen3_comm() {
  # the megakernel at R = 1 on qwen3_30b: 2 comm CTAs ran 5.30 ms, 4 ran 3.33 (fifth session,
  # run 31) though at one rank they only run the barrier: one recorded call of each
  for c in 2l 4l; do
    timeout -s KILL 120 python3 -u tools/megakernel_probe.py --shapes qwen3_30b --comm "$c" \
      --timeline "$c" --out "$out/qwen3_$c" 2>&1 | grep -v Warn | cut -c1-160 | tail -3
    timeout -s KILL 60 python3 -m mok_cute.cli timeline --from "$out/qwen3_$c/qwen3_30b_megakernel_timeline.npy" \
      --out "$out/qwen3_$c" 2>&1 | grep -E "busy|wait|idle|TFLOP|exposed" | tail -6
  done
}

run_order() {
  timeout -s KILL 240 python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore -o timeout=60 \
    --tb=short tests/test_megakernel.py > "$out/test_megakernel.log" 2>&1
  echo "megakernel tests rc=$?: $(grep -E "passed|failed" "$out/test_megakernel.log" | tail -1)"
  grep -E "^FAILED|Error" "$out/test_megakernel.log" | head -5
  timeout -s KILL 300 python3 -u tools/megakernel_probe.py \
    --shapes qwen3_30b,mixtral,gptoss_120b,dsv3_ep8_rank,sonic_120b \
    --comm 2lc,2l,1l,2lf,2lw,2lwf,1lwf --rounds 2 --out "$out" \
    --json "$out/megakernel_probe_order.json" 2>&1 | grep -v Warn \
    | sed -E "s/'first_call_s': [0-9.]+, //; s/'ms_rounds': \[[^]]*\], //" | cut -c1-230
}


find_ncu() {
  # the Nsight Compute CLI's path (not always on PATH on the GPU host)
  local ncu
  ncu="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)"
  [ -n "$ncu" ] || { echo "no ncu on this machine" >&2; return 1; }
  echo "$ncu"
}
run_ncu() {
  # run_ncu [KERNEL_REGEX [ncu_layer.py args...]]: the metrics this ncu knows (an unknown name
  # fails the whole run), then one ncu run per shape
  local kernels="${1:-.}"
  shift || true
  local want="${NCU_METRICS:-dram__bytes_read.sum dram__bytes_write.sum lts__t_bytes.sum lts__t_sector_hit_rate.pct
    smsp__inst_executed.sum gpu__time_duration.sum sm__cycles_elapsed.avg.per_second
    sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
    sm__inst_executed_pipe_lsu.sum l1tex__t_bytes.sum}"
  local ncu
  ncu="$(find_ncu)" || return 1
  "$ncu" --version | tail -1
  "$ncu" --query-metrics --chip gh100 > "$out/ncu_metrics.txt" 2>&1
  local metrics="" m
  for m in $want; do
    if grep -qE "^\s*${m%%.*}\b" "$out/ncu_metrics.txt"; then metrics="$metrics,$m"; else echo "ncu lacks $m"; fi
  done
  metrics="${metrics#,}"
  [ -n "$metrics" ] || metrics="dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum"
  echo "metrics: $metrics"
  local shape csvs=""
  for shape in ${NCU_SHAPES:-mixtral qwen3_30b}; do
    timeout -s KILL 240 "$ncu" --profile-from-start off --clock-control none --csv \
      --kernel-name "regex:$kernels" --metrics "$metrics" --log-file "$out/ncu_$shape.csv" \
      python3 tools/ncu_layer.py --shapes "$shape" "$@" 2>&1 | grep -v Warn | tail -3
    csvs="$csvs $out/ncu_$shape.csv"
  done
  # shellcheck disable=SC2086
  python3 tools/ncu_summary.py $csvs --json "$out/ncu_summary.json" 2>&1 | cut -c1-400
  rm -f "$out/ncu_metrics.txt"
}
run_ncu_source() {
  # run_ncu_source [KERNEL_REGEX [ncu_layer.py args...]]
  local ncu shape kernels="${1:-Megakernel|GroupedGemm}"
  shift || true
  ncu="$(find_ncu)" || return 1
  for shape in ${NCU_SHAPES:-mixtral qwen3_30b}; do
    timeout -s KILL 200 "$ncu" --profile-from-start off --clock-control none \
      --kernel-name "regex:$kernels" --section SourceCounters -f -o "$out/src_$shape" \
      python3 tools/ncu_layer.py --shapes "$shape" "$@" 2>&1 | grep -v Warn | tail -2
    "$ncu" -i "$out/src_$shape.ncu-rep" --page source --print-source sass --csv \
      > "$out/ncu_source_$shape.csv" 2> "$out/ncu_source_$shape.err"
    head -c 600 "$out/ncu_source_$shape.err"
    rm -f "$out/src_$shape.ncu-rep"
    python3 tools/ncu_source_summary.py "$out/ncu_source_$shape.csv" --top 8 2>&1 | cut -c1-160
    gzip -f "$out/ncu_source_$shape.csv"
  done
}
run_one_batch() {
  # minibatch_tokens = the schedule's capacity (qwen3 147328 rows, mixtral 17408): one
  # minibatch, so FC1 and FC2 tiles of different minibatches never share the GPU's L2
  timeout -s KILL 200 python3 tools/megakernel_probe.py --shapes qwen3_30b --comm 0lxwfkuesmhj \
    --minibatch-tokens 1024,147328 --rounds 4 --json "$out/one_batch_qwen3.json" 2>&1 \
    | grep -v Warn | grep "paired" | cut -c1-200
  timeout -s KILL 200 python3 tools/megakernel_probe.py --shapes mixtral --comm 0lxwfkuesmhj \
    --minibatch-tokens 1024,17408 --rounds 4 --json "$out/one_batch_mixtral.json" 2>&1 \
    | grep -v Warn | grep "paired" | cut -c1-200
}
# SonicMoE's kernel cache in the repository root (ignored): it outlives a call while the machine
# stays warm (a call within 30 s of the last), so sonicwarm can compile ahead of sonicall.
SONIC_CACHE=.quack_cache
run_sonic_warm() {
  # run_sonic_warm SHAPES: compile and autotune SonicMoE shape by shape (2-3 min each, run 149),
  # one process, the time of each printed; what finishes before the limit stays cached
  local start=$SECONDS
  timeout -s KILL "${WARM_SECS:-540}" python3 -u -m mok_cute.cli bench --shapes "$1" --contenders sonicmoe \
    --iters 1 --warmup 1 --out "$out/warm" --tag sonic_warm --quack-cache "$SONIC_CACHE" 2>&1 \
    | while IFS= read -r line; do echo "[$((SECONDS - start)) s] $line"; done | grep -E "sonicmoe|shape|Error|error" | tail -20
  du -sh "$SONIC_CACHE" 2>/dev/null
}
run_sonic_all() {
  # run_sonic_all TAG: the bench of record on all five one-GPU shapes with SonicMoE beside
  # mok_cute, the torch pipeline and cuBLAS (after sonicwarm, so no autotuning in it)
  timeout -s KILL "${BENCH_SECS:-560}" python3 -m mok_cute.cli bench --shapes single \
    --contenders mok_cute,torch_grouped_mm,sonicmoe,cublas_8192 --mok-config check_ids=False \
    --iters 20 --warmup 5 --rounds "${BENCH_ROUNDS:-7}" --out "$out" --tag "$1" --quack-cache "$SONIC_CACHE" 2>&1 | grep -E "│|json|png"
}
run_single_bench() {
  # run_single_bench TAG: the one-GPU bench of record on the five single-GPU shapes
  timeout -s KILL 280 python3 -m mok_cute.cli bench --shapes single \
    --contenders mok_cute,mok_megakernel,torch_grouped_mm,cublas_8192 --mok-config check_ids=False \
    --iters 20 --warmup 5 --rounds 7 --out "$out" --tag "$1" 2>&1 | grep -E "│|json"
}
run_final() {
  # run_final VIRTUAL_TAG SINGLE_TAG: the megakernel's tests against the reference (all of them
  # outgrew one call: megatests, switchtests), then the virtual R = 8 and one-GPU benches
  gpu_tests_passed megakernel "virtual_megakernel_matches or one_gpu_megakernel_equals" 180
  run_virtual_bench "$1"
  run_single_bench "$2"
}
run_virtual_comm() {
  # comm CTAs at virtual R = 8: qwen3.5's recorded call (run 58) had its 12 comm CTAs ~87 %
  # busy and FC1 paced by DISPATCH from 3 ms on (FC1 tiles 47 -> 76 us as M-tiles of one
  # expert stopped running together); 12 was swept on dsv3 / sonic only
  virtual_probe 420 qwen3.5_397b,glm_5.2,kimi_k2.7 12k,16k,20k,24k virtual_comm
}
run_qwen35_comm() {
  # qwen3.5 at virtual R = 8 is 1.153 x R = 1 with 16 comm CTAs (runs 61, 65): the neighbours
  virtual_probe 300 qwen3.5_397b 14ku,16ku,18ku virtual_qwen35_comm
}
run_flat_copy() {
  # the comm CTAs' flat row copy (megakernel.COMM_COPY_VECTORS, ninth session): bitwise tests,
  # then virtual R = 8 with the per-row copy against 16 / 24 vectors per lane, and with fewer
  # comm CTAs (what a faster copy should allow)
  gpu_tests_passed flat_copy "flat_comm_copy" 150 || return 1
  for spec in "qwen3.5_397b 16ku,16kuv16,16kuv24,12kuv24" "glm_5.2 10ku,10kuv16,10kuv24,8kuv24"; do
    set -- $spec
    virtual_probe 200 "$1" "$2" "virtual_flat_copy_$1"
  done
}
run_cluster() {
  # the cooperative GEMMs in clusters of two CTAs multicasting B (ops.GEMM_CLUSTER_M, ninth
  # session): bitwise GPU tests, the GEMMs alone (tools/gemm_probe.py, plain against cluster,
  # bitwise), then the layer bench with each setting
  gpu_tests_passed cluster "cluster" 150 tests/test_gemm_sm90.py || return 1
  timeout -s KILL 200 python3 tools/gemm_probe.py --shapes dsv3_ep8_rank,sonic_120b,mixtral \
    --variants 256:8,256c:8,256:8,256c:8 --json "$out/gemm_probe_cluster.json" 2>&1 | grep -v Warn | tail -40
  for c in 1 2; do
    MOK_GEMM_CLUSTER_M=$c timeout -s KILL 150 python3 -m mok_cute.cli bench --shapes single \
      --contenders mok_cute,torch_grouped_mm --mok-config check_ids=False --iters 20 --warmup 5 \
      --rounds 3 --out "$out" --tag gemm_cluster$c 2>&1 | grep -E "mok_cute|json"
  done
}
run_cluster_ab() {
  # clusters of two against one, interleaved (run 73's sequential pairs drifted by up to 13 %
  # between identical variants): the GEMMs alone, 6 alternating rounds, then the expert path
  # layer (tools/megakernel_probe.py --cluster), 8 alternating rounds, on the five shapes
  timeout -s KILL 240 python3 tools/gemm_probe.py --shapes dsv3_ep8_rank,sonic_120b,mixtral,gptoss_120b,qwen3_30b \
    --variants 256:8,256c:8 --rounds 6 --iters 10 --json "$out/gemm_probe_cluster_ab.json" 2>&1 | grep -v Warn | tail -40
  timeout -s KILL 300 python3 tools/megakernel_probe.py --shapes dsv3_ep8_rank,sonic_120b,mixtral,gptoss_120b,qwen3_30b \
    --comm "" --cluster --rounds 8 --json "$out/layer_cluster_ab.json" 2>&1 | grep -v Warn | tail -20
  python3 - "$out/layer_cluster_ab.json" <<'PY'
import json, sys
for s in json.load(open(sys.argv[1]))["shapes"]:
    print(s["shape"], [(r["variant"], [round(t, 3) for t in r["ms_rounds"]], r.get("bitwise_equal_expert_path")) for r in s["results"]])
PY
}
run_decoded() {
  # the producer's warp 0 resolves each compute ticket and hands the words to the other warps
  # (megakernel.DECODED_TICKETS, eleventh session): bitwise tests, then interleaved probes
  gpu_tests_passed decoded "decoded_tickets" 200 || return 1
  timeout -s KILL 300 python3 tools/megakernel_probe.py --shapes dsv3_ep8_rank,sonic_120b,mixtral,gptoss_120b,qwen3_30b \
    --comm 2lxwfku,2lxwfkue --cluster --rounds 6 --json "$out/layer_decoded_ab.json" 2>&1 | grep -v Warn \
    | sed -E "s/'ms_rounds': \[[^]]*\], //" | cut -c1-260 | tail -25
}
run_decoded_virtual() {
  virtual_probe 200 qwen3.5_397b 16ku,16kue "virtual_decoded_qwen35"
  virtual_probe 200 glm_5.2 10ku,10kue,8kue "virtual_decoded_glm"
}
run_switch_tests() {
  # the GPU tests of the eleventh session's three megakernel switches (STORE_WARP_SIGNALS,
  # KSUM_STAGED, PINGPONG): each bitwise against the other setting, recorded, against the
  # reference (a hang is the risk: the 90 s per-test timeout and this limit kill it)
  gpu_tests_passed switches "store_warp_signals or staged_ksum or pingpong_consumers" 330
}
run_ksum_rows_virtual() {
  # (run 98) 8-token KSUM tasks against 16 at virtual R = 8 (qwen3.5 and glm; the one-GPU
  # shapes were runs 95 and 97), then the one-GPU bench of record with the thirteenth
  # session's defaults (1 comm CTA at one rank, 8-token KSUM tasks)
  virtual_probe 240 qwen3.5_397b,glm_5.2 16kuesm,16kuesmh "virtual_ksum_rows"
  run_single_bench "${1:-expert_kernels}"
}
run_one_barrier() {
  # (run 101) ONE_EPILOGUE_BARRIER, both paths: 6 interleaved rounds on the five shapes (the
  # expert path with it flipped; the megakernel default and q), every output bitwise against
  # the expert path; then its GPU tests, the GEMM's and the megakernel's
  layer_probe 150 layer_one_epilogue_barrier_ab --comm 1lxwfkuesmh,1lxwfkuesmhq --one-barrier --rounds 6
  gpu_tests_passed one_barrier "one_epilogue_barrier" 150 tests/test_gemm_sm90.py tests/test_megakernel.py
}
run_short_start() {
  # SHORT_TASK_START (written in the thirteenth session after its device time was spent): its
  # GPU tests (bitwise against it off, recorded, against the reference; a hang or a wrong row
  # is the risk), then 8 interleaved rounds on the five shapes, then dsv3 and gptoss recorded
  # with it off and on: the STAGE_WAIT lines say how long the consumers waited for a task's
  # first stage, which is what it should shorten
  gpu_tests_passed short_start "short_task_start" 200 || return 1
  layer_probe 150 layer_short_task_start_ab --comm 1lxwfkuesmh,1lxwfkuesmhj --rounds 8
  for shape in dsv3_ep8_rank gptoss_120b; do
    for on in 0 1; do
      MOK_SHORT_TASK_START=$on record_summary 60 "$out/${shape}_short$on" "layer|every|STAGE_WAIT|FC1 " \
        --shape $shape --capacity 262144 --mok-config check_ids=False --mok-config backend=megakernel
      rm -f "$out/${shape}_short$on/timeline_buffer.npy"
    done
  done
}
run_zero_comm() {
  # num_comm_sms=0 at one rank (written in the fourteenth session): the GPU tests (bitwise
  # against one comm CTA, recorded, against the reference, refused elsewhere), then 8
  # interleaved rounds on the five shapes, one comm CTA against none
  gpu_tests_passed zero_comm "zero_comm" 200 || return 1
  layer_probe 200 layer_zero_comm_ab --comm 1lxwfkuesmhj,0lxwfkuesmhj --rounds 8
}
run_fence_probe() {
  # The megakernel's SASS k-loop differs from the expert FC1's only by the proxy fence after
  # each stage's wait (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S, gemm_sm90.FENCE_GATHERED_A), and it
  # is emitted on every GEMM task, FC2's TMA-loaded stages included; last timed in run 21 (a
  # much older kernel: level). FENCE_FC1_ONLY (letter i) fences FC1's gathered stages only;
  # the letter n drops the fence everywhere, an upper bound (unsafe: checked bitwise only)
  # (its GPU tests passed in run 109; the probe of that run was killed by its time limit)
  layer_probe 420 layer_gathered_fence_ab --comm 0lxwfkuesmhj,0lxwfkuesmhji --rounds 6
}
run_switch_probe() {
  # (run 90) the eleventh session's variants against the default of then, interleaved: the
  # megakernel at R = 1 on the five shapes (8 alternating rounds; s = STORE_WARP_SIGNALS,
  # m = KSUM_STAGED, o = PINGPONG), then
  # qwen3.5 at virtual R = 8 against R = 1 with the pingpong loop and the staged k-sum
  layer_probe 330 layer_new_variants_ab --comm 2lxwfkue,2lxwfkues,2lxwfkuem,2lxwfkueo --rounds 8
  virtual_probe 200 qwen3.5_397b 16kue,16kueo,16kuem "virtual_new_variants_qwen35"
}
run_virtual_bench() {
  # run_virtual_bench TAG: the virtual R = 8 bench of record on MoK's four shapes (as run 51)
  timeout -s KILL "${VBENCH_SECS:-300}" python3 -m mok_cute.cli bench --shapes kimi_k2.7,glm_5.2,qwen3.5_397b,dsv4_pro \
    --ep-ranks 8 --contenders mok_megakernel,mok_cute_virtual,cublas_8192 --mok-config check_ids=False \
    --iters 10 --warmup 3 --rounds "${VBENCH_ROUNDS:-2}" --out "$out" --tag "$1" 2>&1 | tail -12
}
run_gap_record() {
  # the one-rank gap, recorded: dsv3, gptoss and mixtral on the expert path and on the
  # megakernel (summaries only: task periods, overlap, the KSUM tail), to split each shape's
  # megakernel / expert difference into tiles, gaps and tail (run 96); since the thirteenth
  # session the megakernel's recording also has STAGE_WAIT spans: its consumers waiting for a
  # GEMM task's first stage, i.e. for the producer (FC1 tiles run 2-6 % slower per tile there)
  for shape in dsv3_ep8_rank gptoss_120b mixtral; do
    for backend in kernel megakernel; do
      record_summary 90 "$out/${shape}_$backend" "layer|every|KSUM|FC2 |STAGE_WAIT|FC1 " --shape $shape \
        --capacity 262144 --mok-config check_ids=False --mok-config backend=$backend
      rm -f "$out/${shape}_$backend/timeline_buffer.npy"
    done
  done
}
run_tail_record() {
  # (run 112) mixtral and qwen3 (the shapes furthest from the expert path) recorded on both
  # paths with the current defaults (no comm CTA); the raw buffers come back, to be read here:
  # when each lane's last GEMM ends, the waits before FC2 and KSUM tasks, the k-sum tail. Since
  # run 112 the megakernel's GEMM tasks also record their EPILOGUE and SIGNAL phases, whose
  # GPU test runs first
  gpu_tests_passed recorder "recorded_megakernel_timeline" 150
  for shape in mixtral qwen3_30b; do
    for backend in kernel megakernel; do
      record_summary 90 "$out/${shape}_$backend" "layer|every|KSUM|FC2 |FC1 |WAIT|EPILOGUE|SIGNAL" --shape $shape \
        --capacity 262144 --mok-config check_ids=False --mok-config backend=$backend
      mv "$out/${shape}_$backend/timeline_buffer.npy" "$out/${shape}_${backend}_buffer.npy" 2>/dev/null
      rm -rf "$out/${shape}_$backend"
    done
  done
}
run_switch_record() {
  # RECORD_SWITCH (a megakernel switch, e.g. WIDE_EPILOGUE) off and on, each shape of
  # RECORD_SHAPES (default qwen3_30b) recorded on the megakernel: summaries (task periods,
  # EPILOGUE / SIGNAL phases) and the raw buffers
  : "${RECORD_SWITCH:?set RECORD_SWITCH}"
  local shape on
  for shape in ${RECORD_SHAPES:-qwen3_30b}; do
    for on in 0 1; do
      export "MOK_${RECORD_SWITCH}=$on"
      record_summary 90 "$out/${shape}_$on" "layer|every|KSUM|FC2 |FC1 |WAIT|EPILOGUE|SIGNAL" \
        --shape $shape --capacity 262144 --mok-config check_ids=False \
        --mok-config backend=megakernel
      mv "$out/${shape}_$on/timeline_buffer.npy" "$out/${shape}_${RECORD_SWITCH}$on.npy" 2>/dev/null
      rm -rf "$out/${shape}_$on"
    done
  done
  unset "MOK_${RECORD_SWITCH}"
}
run_virtual_record() {
  # qwen3.5 at virtual R = 8 and the same problem at one rank (--t-scale 8: 16384 tokens, all
  # 512 experts) recorded; the recordings go back as one tarball (a call returns at most 8 files)
  local rec="$out/recordings"
  mkdir -p "$rec"
  for r in 8 1; do
    local scale=$((8 / r))  # the same 16384 tokens at both
    record_summary 120 "$rec/qwen35_r$r" "TFLOP|FC1 |FC2 |DISPATCH|COMBINE|KSUM|WAIT" \
      --shape qwen3.5_397b --ranks $r --t-scale $scale --capacity 262144 \
      --mok-config check_ids=False --mok-config backend=megakernel
  done
  tar -C "$out" -czf "$out/recordings.tgz" recordings && rm -rf "$rec"
}
run_ksum() {
  # the one-rank megakernel with 1 comm CTA instead of 2 (the comm CTAs only run the barrier
  # there) and its KSUM with 16 vectors in flight per lane (megakernel.KSUM_VECTORS): bitwise
  # tests, then the five single-GPU shapes and two MoK shapes at virtual R = 8
  gpu_tests_passed ksum_vectors "ksum_vectors" 150 || return 1
  timeout -s KILL 240 python3 -u tools/megakernel_probe.py \
    --shapes dsv3_ep8_rank,sonic_120b,mixtral,qwen3_30b,gptoss_120b --comm 2lwfxk,1lwfxk,1lwfxku \
    --rounds 3 --out "$out" --json "$out/megakernel_probe_ksum.json" 2>&1 \
    | grep -v Warn | sed -E "s/'first_call_s': [0-9.]+, //; s/'variant': '[a-z0-9_]*', //" | cut -c1-200
  virtual_probe 180 qwen3.5_397b,glm_5.2 12k,12ku virtual_ksum
}
run_why() {
  # recorded calls behind issue 4's two open gaps, task durations per type in each summary:
  # mixtral's megakernel at R = 1 against its expert path (1.08-1.14x), and qwen3.5 at
  # virtual R = 8 against R = 1 (1.26x, copy floor 1.13)
  timeout -s KILL 100 python3 -m mok_cute.cli timeline --shape mixtral --mok-config check_ids=False \
    --out "$out/mixtral_expert" 2>&1 | grep -E "busy|TFLOP|FC1|FC2|ms" | tail -8
  timeout -s KILL 120 python3 -m mok_cute.cli timeline --shape mixtral --capacity 262144 \
    --mok-config check_ids=False --mok-config backend=megakernel --out "$out/mixtral_mega" 2>&1 \
    | grep -E "busy|TFLOP|FC1|FC2|ms" | tail -8
  for r in 1 8; do
    timeout -s KILL 120 python3 -m mok_cute.cli timeline --shape qwen3.5_397b --ranks $r \
      --capacity 262144 --mok-config check_ids=False --mok-config backend=megakernel --out "$out/qwen35_r$r" 2>&1 \
      | grep -E "busy|TFLOP|FC1|FC2|DISPATCH|COMBINE|KSUM|ms" | tail -10
  done
}

run_ep_dynamic() {
  # the IPC megakernel with static then dynamic compute tickets (DYNAMIC_TICKETS_IPC), same call
  local n="$1"
  for dyn in 0 1; do
    MOK_DYNAMIC_TICKETS_IPC=$dyn timeout -s KILL 240 torchrun --nproc-per-node "$n" -m mok_cute.cli bench \
      --ep --shapes ep --tokens 2048 --mok-config backend=megakernel --out "$out/dynamic$dyn" \
      --tag ep${n}_dynamic_tickets$dyn 2>&1 | grep -E "mok_cute|json" | tail -6
  done
}

run_ep() {
  local n="$1"
  # issue 7's checks: reference, repeat, comm split, emulated == real (uniform and skewed)
  timeout -s KILL 240 torchrun --nproc-per-node "$n" tools/ep_check.py 2>&1 | grep -E "ranks|PASS|FAIL|Error" | tail -10
  timeout -s KILL 240 torchrun --nproc-per-node "$n" tools/ep_check.py --shape kimi --tokens 1024 \
    2>&1 | grep -E "ranks|PASS|FAIL|Error" | tail -10
  for backend in megakernel reference; do
    timeout -s KILL 240 torchrun --nproc-per-node "$n" examples/ep_torchrun.py --shape kimi \
      --tokens 2048 --backend "$backend" 2>&1 | tail -8
  done
  timeout -s KILL 300 torchrun --nproc-per-node "$n" -m mok_cute.cli bench --ep --shapes ep \
    --tokens 2048 --mok-config backend=megakernel --out "$out" 2>&1 | tail -16
}

run_lead_r8() {
  # dsv4_pro at virtual R = 8, one recorded call with the FC1 lead on and one with it off (the
  # lead costs 15 % there and gains elsewhere: run 42); the .npy files decode on the CPU
  for lead in 1 0; do
    MOK_FC1_LEAD=$lead timeout -s KILL 80 python3 -m mok_cute.cli timeline --shape dsv4_pro --ranks 8 \
      --capacity 262144 --mok-config check_ids=False --out "$out/dsv4_r8_lead$lead" 2>&1 \
      | grep -E "busy|wait|idle|TFLOP|exposed|tasks|ms" | tail -8
  done
}


run_glue() {
  # where a layer call's time goes besides the GEMMs (mixtral: GEMMs 7.72 ms alone against
  # 8.57 for the call, run 37), and mixtral's GEMMs by rasterisation group (group_m 8/16/32)
  timeout -s KILL 200 python3 -u tools/layer_profile.py --shapes mixtral,dsv3_ep8_rank,qwen3_30b \
    --json "$out/layer_profile.json" 2>&1 | grep -v Warn
  timeout -s KILL 240 python3 -u tools/gemm_probe.py --shapes mixtral --variants 256:8,256:16,256:32,256:8 \
    --json "$out/gemm_probe_group_m.json" 2>&1 | grep -v Warn | grep -E "mok|torch|cublas"
}

run_tickets() {
  # dynamic compute tickets (megakernel.DYNAMIC_TICKETS): bitwise tests, then virtual R = 8
  # and R = 1 with static and dynamic tickets (alternating rounds), then R = 1 single-GPU shapes
  gpu_tests_passed dynamic "dynamic" 140 || return 1
  virtual_probe 280 dsv4_pro,kimi_k2.7,glm_5.2,qwen3.5_397b 12,12k virtual_dynamic
  timeout -s KILL 170 python3 -u tools/megakernel_probe.py --shapes dsv3_ep8_rank,mixtral,qwen3_30b \
    --comm 2lwfx,2lwfxk --rounds 3 --out "$out" --json "$out/r1_dynamic.json" 2>&1 \
    | grep -v Warn | sed -E "s/'first_call_s': [0-9.]+, //; s/'variant': '[a-z0-9_]*', //" | cut -c1-200
}

case "$what" in
  tests) run_tests ;;
  bench) run_bench ;;
  sonic) run_sonic "${2:-vs_sonicmoe}" ;;
  sonicwarm) run_sonic_warm "${2:-qwen3_30b,gptoss_120b,mixtral,dsv3_ep8_rank,sonic_120b}" ;;
  sonicall) run_sonic_all "${2:-all_vs_sonicmoe}" ;;
  sonicsustained) timeout -s KILL "${PROBE_SECS:-300}" python3 -u tools/cap_ceiling_probe.py \
      --shapes "${PROBE_SHAPES:-qwen3_30b,gptoss_120b,mixtral,dsv3_ep8_rank,sonic_120b}" \
      --variants layer,sonicmoe --rounds "${PROBE_ROUNDS:-3}" --seconds 2 --quack-cache "$SONIC_CACHE" \
      --json "$out/cap_ceiling_sonicmoe.json" 2>&1 | grep -v Warn | tail -45 ;;
  mega) run_mega ;;
  gemm) run_gemm ;;
  schedule) run_schedule ;;
  virtual) run_virtual ;;
  qwen3comm) run_qwen3_comm ;;
  order) run_order ;;
  leadr8) run_lead_r8 ;;
  glue) run_glue ;;
  tickets) run_tickets ;;
  ep) run_ep "${2:-2}" ;;
  epdyn) run_ep_dynamic "${2:-2}" ;;
  why) run_why ;;
  ksum) run_ksum ;;
  virtualbench) run_virtual_bench "${2:-virtual_r8}" ;;
  virtualrecord) run_virtual_record ;;
  virtualcomm) run_virtual_comm ;;
  final) run_final "${2:-virtual_r8}" "${3:-expert_kernels}" ;;
  singlebench) run_single_bench "${2:-expert_kernels}" ;;
  # the megakernel's GPU tests take longer than one call (run 92): megatests, megatests2 (the
  # later switches and the end-to-end checks; run 134 stopped before them) and switchtests
  megatests) gpu_tests_passed megakernel "not (store_warp_signals or staged_ksum or pingpong_consumers or ksum_rows or one_epilogue_barrier or short_task_start or fence_fc1_only) and not ($MEGA_SECOND)" 420 ;;
  megatests2) gpu_tests_passed megakernel2 "$MEGA_SECOND" 420 ;;
  switchtests) run_switch_tests ;;
  rowstests) gpu_tests_passed rows_barrier "ksum_rows or one_epilogue_barrier" 300 ;;
  gaprecord) run_gap_record ;;
  tailrecord) run_tail_record ;;
  deferprobe) gpu_tests_passed defer "defer_signals or recorded_megakernel_timeline" 220
              layer_probe 340 layer_defer_signals_ab --comm 0lxwfkuesmhj,0lxwfkuesmhjv --rounds 6 ;;
  ncu) run_ncu ;;
  ncul2) NCU_METRICS="${L2_METRICS}" run_ncu "${2:-.}" "${@:3}" ;;
  ncusource) run_ncu_source ;;
  ncusourcering) run_ncu_source Megakernel --set LOCAL_DIRECT=0 ;;
  ncuring) run_ncu Megakernel --set LOCAL_DIRECT=0 ;;
  onebatch) run_one_batch ;;
  releaseprobe) gpu_tests_passed release "release_only_publish" 240
                layer_probe 330 layer_release_only_publish_ab \
                  --comm 0lxwfkuesmhj,0lxwfkuesmhjv,0lxwfkuesmhja,0lxwfkuesmhjva --rounds 6 ;;
  stridedprobe) gpu_tests_sharded strided "strided_tickets" 200 10 tests/test_megakernel.py
                switch_clock_probe 360 "${PROBE_SHAPES:-gptoss_120b,mixtral,dsv3_ep8_rank,qwen3_30b,sonic_120b}" \
                  STRIDED_TICKETS 4 clock_probe_strided ;;
  strideddefault) gpu_tests_sharded mega "" 220 12 tests/test_megakernel.py
                  run_single_bench "${2:-strided_tickets}" ;;
  ticketclock) switch_clock_probe 330 "${PROBE_SHAPES:-mixtral,gptoss_120b,dsv3_ep8_rank}" \
                 DYNAMIC_TICKETS 4 clock_probe_tickets ;;
  deferclock) switch_clock_probe 300 qwen3_30b,dsv3_ep8_rank,gptoss_120b DEFER_SIGNALS 3 \
                clock_probe_defer ;;
  warp0probe) gpu_tests_passed warp0 "warp0_tma_stages" 200
              layer_probe 240 layer_warp0_tma_stages_ab --comm 0lxwfkuesmhj,0lxwfkuesmhjz --rounds 6
              switch_clock_probe 240 mixtral,qwen3_30b,gptoss_120b WARP0_TMA_STAGES 3 \
                clock_probe_warp0 ;;
  wideprobe) gpu_tests_passed wide "wide_epilogue or recorded_megakernel_timeline" 330 \
               tests/test_megakernel.py tests/test_gemm_sm90.py
             layer_probe "${PROBE_SECS:-300}" layer_wide_epilogue_ab \
               --comm 0lxwfkuesmhj,0lxwfkuesmhjg --wide-epilogue --rounds "${PROBE_ROUNDS:-6}" ;;
  switchrecord) run_switch_record ;;
  flushprobe) gpu_tests_passed flush "defer_flush or defer_signals" 300
              layer_probe "${PROBE_SECS:-280}" layer_defer_flush_ab \
                --comm 0lxwfkuesmhj,0lxwfkuesmhjv,0lxwfkuesmhjvy,0lxwfkuesmhjvr \
                --rounds "${PROBE_ROUNDS:-6}" ;;
  clockprobe) timeout -s KILL 300 python3 tools/clock_probe.py --shapes mixtral,qwen3_30b,gptoss_120b \
                --json "$out/clock_probe.json" 2>&1 | grep -v Warn | tail -30 ;;
  experttests) gpu_tests_passed expert "" 300 tests/test_moe_forward_gpu.py tests/test_token_ops.py ;;
  # (nineteenth session) ops.KSUM_IN_FC2: its GPU tests, then the expert path with and without
  # it, sustained (2 s per variant, 3 alternating rounds), bitwise checked first
  ksumprobe) gpu_tests_sharded ksum "ksum" 240 6 tests/test_moe_forward_gpu.py
    timeout -s KILL "${PROBE_SECS:-300}" python3 tools/clock_probe.py --no-megakernel \
      --shapes "${PROBE_SHAPES:-dsv3_ep8_rank,sonic_120b,qwen3_30b,gptoss_120b}" --rounds 3 \
      --expert-switch KSUM_IN_FC2 --json "$out/clock_probe_ksum_in_fc2.json" 2>&1 | grep -v Warn | tail -40 ;;
  # where the fused k-sum's time goes (tools/ksum_fc2_probe.py: built in stages, and deferred);
  # the probe runs only if every ksum test passed
  ksumdiag) gpu_tests_sharded ksum "ksum" 240 8 tests/test_moe_forward_gpu.py &&
    timeout -s KILL "${PROBE_SECS:-300}" python3 tools/ksum_fc2_probe.py \
      --shapes "${PROBE_SHAPES:-dsv3_ep8_rank,sonic_120b,qwen3_30b}" --rounds 4 \
      --json "$out/ksum_fc2_probe.json" 2>&1 | grep -v Warn | tail -30 ;;
  qwen35comm) run_qwen35_comm ;;
  flatcopy) run_flat_copy ;;
  cluster) run_cluster ;;
  clusterab) run_cluster_ab ;;
  decoded) run_decoded ;;
  decodedvirtual) run_decoded_virtual ;;
  onebarrier) run_one_barrier ;;
  shortstart) run_short_start ;;
  zerocomm) run_zero_comm ;;
  fenceprobe) run_fence_probe ;;
  ksumrowsvirtual) run_ksum_rows_virtual "${2:-expert_kernels}" ;;
  switchprobe) run_switch_probe ;;
  directprobe) layer_probe "${PROBE_SECS:-420}" layer_local_direct_ab \
                --comm 0lxwfkuesmhjvr,1xwfkuesmhjvr,2xwfkuesmhjvr,4xwfkuesmhjvr \
                --rounds "${PROBE_ROUNDS:-4}" ;;
  alltests) gpu_tests_sharded all "${TEST_EXPR:-}" "${TEST_SECS:-540}" "${TEST_SHARDS:-12}" ;;
  testbench) gpu_tests_passed expert "" 330 tests/test_moe_forward_gpu.py tests/test_token_ops.py tests/test_gemm_sm90.py
             run_single_bench "${2:-expert_kernels}" ;;
  all) run_tests; run_bench ;;
  *) echo "usage: $0 [tests|bench|sonic|sonicwarm [SHAPES]|sonicall [TAG]|sonicsustained|mega|gemm|schedule|virtual|qwen3comm|order|leadr8|glue|tickets|ep N|epdyn N|why|ksum|virtualbench [TAG]|virtualrecord|virtualcomm|final|singlebench [TAG]|megatests|experttests|qwen35comm|flatcopy|cluster|clusterab|decoded|decodedvirtual|switchtests|switchprobe|rowstests|ksumrowsvirtual [TAG]|onebarrier|shortstart|zerocomm|fenceprobe|gaprecord|tailrecord|clockprobe|warp0probe|deferprobe|deferclock|releaseprobe|ncu|ncusource|ncusourcering|ncuring|onebatch|wideprobe|switchrecord|flushprobe|megatests2|testbench [TAG]|alltests|directprobe|ncul2 [REGEX ARGS]|ticketclock|stridedprobe|strideddefault [TAG]|all]" >&2; exit 2 ;;
esac
