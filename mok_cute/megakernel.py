"""Host side of the megakernel: buffers, schedules, the task list and one launch per call.

    moe_forward_virtual (R ranks on one GPU)   -> Plan(_VirtualSide)  R ranks in one launch
    moe_forward (one GPU, group=None)          -> the same with R = 1
    moe_forward (group=..., one process/GPU)   -> Plan(_IpcSide)      this rank's launch; peers'
                                                  buffers mapped through comm.ipc

A plan is built once per (shapes, config, device) and reused: the symmetric peer buffers,
the ring buffers, the encoded task list and the compiled kernel. A call then copies x into
the symmetric buffers, builds the receive schedules on the device (no host sync), bumps the
epoch on the device, zeroes the counters and launches the kernel once.

The kernel's error word (a bounded wait timed out) is read back without a sync: it is copied
into one of a few pinned words after the launch; each call polls the earlier copies without
waiting (``Event.query``) and raises for the first that holds an error; the call's id check
(``check_ids``) and ``raise_pending_errors()`` wait for all of them. Waiting for the previous
launch at the start of a call would idle the GPU for the host work of every call (about 1 ms
on dsv3, `docs/sim.md`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading

import torch

from mok_cute import jit, tasks as tasks_mod
from mok_cute.config import MoKConfig, experimental_setting, experimental_switch

TILE_M = 128
TASK_TILE_N = 256  # = kernels.megakernel_sm90.TASK_TILE_N (output columns of an FC1 / FC2 task)
PINGPONG_TILE_N = 128  # = kernels.megakernel_sm90.PINGPONG_TILE_N (the same, pingpong)
DEFAULT_COMM_CTAS = 12
LOCAL_DIRECT_COMM_CTAS = 10  # the floor with several ranks copying only their remote rows
# How comm CTAs move rows (kernels.megakernel_sm90.COPY_MODES); a module setting so tools
# can time both in one process.
COMM_COPY = "vector"
# Rows a rank routes to its own experts are never copied: FC1's producer warpgroup reads them
# from x (no DISPATCH copy) and the k-sum reads their y from the ring (no COMBINE copy); needs
# a ring that never wraps. At R = 1 that removes all comm traffic: dsv3_ep8_rank 6.26 -> 5.35
# ms, sonic_120b 12.96 -> 12.31 ms, bitwise equal (H200, docs/gpu_runs.md run 20).
LOCAL_DIRECT = True
# FC1 of minibatch m + L queued before FC2 of m (tasks.build_task_list's fc1_lead), so FC2
# tiles do not wait on the FC1 wave just issued. L is the fewest minibatches whose FC1 tiles
# fill every compute CTA (`fc1_lead_minibatches`): 1-2 on dsv3 / sonic, 3 on qwen3_30b (48
# FC1 tiles per minibatch against 130 CTAs, so without a lead most of a wave waits). A CPU
# model of the static ticket stride with measured-rate task times (sixth session) put qwen3
# R = 1 at 3.17 ms without a lead and 2.24 with L = 3. Measured on the H200 (sixth session,
# tools/megakernel_probe.py, 2 alternating rounds, bitwise equal; expert path 2.21 ms): qwen3
# 3.08 -> 2.43 ms. With N_MAJOR_TILES (below) it also pays where the lead is 1-2: gptoss
# 4.31 -> 3.25, dsv3 4.88 -> 4.76, sonic_120b 11.22 -> 10.95 ms. Virtual R = 8 against R = 1
# (mok-cute bench, sixth session) with / without it: kimi 0.97 / 1.19, glm 1.14 / 1.23,
# qwen3.5 1.15 / 1.24, but dsv4_pro 1.27 / 1.05 (43.3 against 37.7 ms at R = 8): on for all.
# The dsv4_pro loss was the static ticket stride letting CTAs drift apart (seventh session,
# gone with DYNAMIC_TICKETS: docs/perf_notes.md). MOK_FC1_LEAD=0 turns it off;
# FC1_LEAD_MINIBATCHES fixes L (tools).
FC1_LEAD = experimental_switch("FC1_LEAD", True)
FC1_LEAD_MINIBATCHES: int | None = None
# A minibatch's FC1 and FC2 tiles N-tile by N-tile (tasks' tile_order="n_major") instead of
# M-tile by M-tile, so the CTAs running at once share each weight tile in L2 as the expert
# path's grouped rasterisation does. Why: with many FC1 N-tiles per M-tile the M-tile-major
# order puts about one M-tile in a wave and every M-tile streams its expert's weights from
# HBM: mixtral (112 FC1 N-tiles, 235 MB of gate/up weights per expert, 128 M-tiles) reads
# ~30 GB, ~8.6 ms at 3.5 TB/s, the size of the megakernel's 11.4 ms against 8.6 for the expert
# path (run 31); N-tile-major reads them once per minibatch (16 x 235 MB). Predicted: mixtral
# R = 1 near the expert path, no change where a minibatch's FC1 tiles fit one wave (dsv3,
# sonic_120b, qwen3_30b). Measured (sixth session, same probe as FC1_LEAD): mixtral 10.99 ->
# 8.69 ms (expert path 8.07); with the FC1 lead as well every shape gains or holds.
# MOK_N_MAJOR_TILES=0 turns it off.
N_MAJOR_TILES = experimental_switch("N_MAJOR_TILES", True)
# Virtual ranks walk the task list block by block (one block per minibatch, each rank's share
# in turn) instead of alternating ranks task by task (tasks.ticket_blocks). Why: virtual R = 8
# costs 1.5-1.8x R = 1 on the H200 (run 23), and the extra time matches re-reading every
# expert's weights once per extra M-tile (kimi: 2 x 33.8 GB at ~4 TB/s = 16 ms of the 18.7 ms
# gap), as alternating ranks puts one M-tile of eight different experts in each wave where R = 1
# has all M-tiles of an expert together. The simulator, which has no L2, predicts <= 10 %.
# Measured on the H200 (fifth session, tools/megakernel_probe.py --virtual, bitwise equal):
# kimi R = 8 48.2 -> 35.9 ms, qwen3.5 22.8 -> 21.3 ms (R = 1: 25.6, 14.0). MOK_RANK_BLOCKS=0
# turns it off.
RANK_BLOCKS = experimental_switch("RANK_BLOCKS", True)
# One rank with no peer and local_direct: nobody else reads this rank's x, so FC1's local rows
# and the shared expert read the caller's x in place instead of a copy in the symmetric buffer
# (dsv3: 59 MB, sonic_120b: 268 MB copied per call, about 0.6 % and 1.2 % of the call at
# ~3.5 TB/s). Bitwise equal on the H200. Sixth session, best of 3 alternating rounds
# (probes/2026-11-29_megakernel_probe_x_in_place.json): dsv3 4.80 -> 4.73 ms, sonic_120b
# 11.06 -> 10.77, the size the copy predicts (rounds drift by up to 15 % as the GPU heats,
# so only the best round is compared). MOK_X_IN_PLACE=0 turns it off.
X_IN_PLACE = experimental_switch("X_IN_PLACE", True)
# Comm CTAs when no rank's rows cross them (one rank, local_direct). Until the sixth session
# the comm queue still held one no-op DISPATCH and COMBINE per M-tile, and the count mattered
# where M-tiles are many (qwen3_30b, 1024 tiles: 2 comm CTAs 5.30 ms, 4: 3.33, run 31):
# COMBINEs waiting on FC2 held up the DISPATCH signals FC1 waits for. Such plans now build
# their list without comm tasks (tasks.build_task_list(comm_tasks=False), LOCAL_ONLY_TASKS),
# so the comm CTAs run the barrier only; 2 (the simulator's pick too). 1 against 2 (one more
# compute CTA, predicted -0.8 %) measured level within the probe's noise on the five shapes
# (run 57: best of 3, -1.1 % to +0.6 %). Thirteenth session, with the paired per-round ratio
# (median of 8 and 10 interleaved rounds, bitwise equal), 1 against 2: run 95 qwen3 0.976,
# mixtral 0.991, dsv3 0.986, gptoss 0.945, sonic 0.997; run 97 0.987, 1.003, 0.984, 0.993,
# 0.996; with 8-token KSUM tasks (KSUM_ROWS) too, against neither, run 97: 0.952, 0.989,
# 0.945, 0.974, 1.000. So 1. Fourteenth session: 0, the BARRIER run by a compute CTA
# (tasks.build_task_list's barrier_in_compute), all 256 consumer threads sharing its wait on
# the FC2 counters (one thread walking qwen3's 1024 of them took ~200 us, run 106). Against 1,
# paired, 8 interleaved rounds, bitwise equal (run 107): qwen3 0.993, mixtral 0.992, dsv3
# 0.980, gptoss 0.985, sonic 1.000. (Its first build had ptxas serialise every wgmma, C7520,
# and ran 7-16 % slower, runs 104-105: the compile tests now refuse serialised wgmmas.) With
# PINGPONG the BARRIER needs its comm CTA: 1 there.
LOCAL_ONLY_COMM_CTAS = 0
LOCAL_ONLY_TASKS = True  # a module setting so tools can time the list with comm tasks too
# Compute CTAs take their tickets from a counter as their producer gets to them, instead of the
# static stride (kernels.megakernel_sm90's dynamic_tickets). Why: with the FC1 lead no compute
# task waits on the wave just issued, and under the stride the CTAs drift apart (each one's
# share of a block mixes FC1 and FC2 tiles differently); at virtual R = 8 on dsv4_pro one
# minibatch's FC1 tiles started over 2.6 ms instead of 0.19 and ran 47 % slower, tiles of
# ~4 ranks at once no longer sharing weight tiles in L2 (recorded timelines, seventh
# session: probes/2026-11-30_dsv4_r8_lead_timelines.json). Measured (probe, same process,
# alternating rounds, bitwise equal; probes/2026-11-30_virtual_dynamic_tickets.json), static
# -> dynamic, R = 1 / virtual R = 8 ms: dsv4_pro 34.18 -> 31.60 / 45.49 -> 34.47, kimi
# 28.72 -> 25.12 / 28.52 -> 28.39, glm 21.52 -> 20.34 / 24.84 -> 23.72, qwen3.5 10.92 ->
# 9.17 / 13.00 -> 12.87; one GPU, best of 3: dsv3 4.80 -> 4.68, mixtral 8.92 -> 8.84, qwen3
# level. On for one GPU (one rank or virtual ranks). Over IPC it passed tools/ep_check.py on
# two GPUs (runs 52-53, bitwise, emulated == real); timed there in run 54 (two GPUs, one bench
# per setting, static -> dynamic): kimi 8.33 -> 9.47 ms, glm 6.92 -> 7.40, qwen3.5 4.52 ->
# 4.44, dsv4_pro 10.62 -> 9.68: mixed, so it stays off for groups (MOK_DYNAMIC_TICKETS_IPC=1).
# MOK_DYNAMIC_TICKETS=0 turns it off. (At one rank the ring has taken its tickets by the
# stride since the eighteenth session: STRIDED_TICKETS.)
DYNAMIC_TICKETS = experimental_switch("DYNAMIC_TICKETS", True)
DYNAMIC_TICKETS_IPC = experimental_switch("DYNAMIC_TICKETS_IPC", False)  # the same over IPC
# With dynamic tickets, the producer's warp 0 resolves each ticket (queue entry, task row,
# live-tile count, expert, signal counter) and hands the consumers the decoded words through
# the smem ticket ring (kernels.megakernel_sm90's decoded_tickets), instead of the bare ticket
# that each consumer warp then resolves with two or three dependent global loads while the
# tensor cores wait. Why: mixtral's recorded call at one rank (run 56) spent 17.5 us per ms per
# CTA between tasks, the expert GEMM 2.2; predicted ~0.9 us less per task: mixtral -1.5 %,
# qwen3_30b (~117 short tasks per CTA) -4 %, dsv3 -1.5 %. Measured (eleventh session, runs 80-81,
# bitwise equal everywhere; median of the per-round ratios of 6 interleaved rounds): one GPU
# dsv3 0.976, sonic_120b 0.975, gptoss 0.978, qwen3 0.974, mixtral 1.005; virtual, median of 3
# rounds, R = 1 qwen3.5 9.79 -> 9.02 ms, glm 20.04 -> 19.57; R = 8 qwen3.5 11.75 -> 11.73, glm
# 22.53 -> 22.30 (paced by the comm CTAs there, so it gains little). On; MOK_DECODED_TICKETS=0
# turns it off.
DECODED_TICKETS = experimental_switch("DECODED_TICKETS", True)
# After a GEMM task only the store warp waits for the tile's TMA stores and publishes its
# counter; the other consumer warps skip the epilogue barrier and start the next task
# (kernels.megakernel_sm90's store_warp_signals). Why: the decoded recordings (run 87) still
# show 12.9 (mixtral) to 32 (qwen3) us per ms per CTA between tasks, mostly that wait, the
# fence and the publish, while both warpgroups idle. Predicted: up to ~1 % on mixtral and
# ~2-3 % on qwen3 if the second warpgroup's mainloop covers the wait. Measured (twelfth
# session, run 90, bitwise equal; median of the per-round ratios of 8 interleaved rounds against
# the default of then): qwen3 0.974, mixtral 0.994, dsv3 0.993, gptoss 0.999, sonic 0.995. On;
# MOK_STORE_WARP_SIGNALS=0 turns it off.
STORE_WARP_SIGNALS = experimental_switch("STORE_WARP_SIGNALS", True)
# The KSUM lanes land their y vectors in the idle B stages with cp.async and sum them from smem
# (kernels.megakernel_sm90's ksum_staged), 32 vectors in flight per lane instead of 16 in
# registers. Why: the k-sum tail after the last FC2 tile is latency-bound on 8 warps per SM
# (mixtral, run 56: 0.11 ms against 0.07 for the expert path's k-sum kernel); 32 vectors in
# registers spill. Predicted: the tail down toward the standalone kernel's time, ~0.5 % on
# mixtral, 1-3 % on qwen3. Measured (twelfth session, run 90, bitwise equal; median of the
# per-round ratios of 8 interleaved rounds against the default of then): qwen3 0.969, mixtral
# 0.975, dsv3 0.993, gptoss 0.997, sonic 0.996; virtual qwen3.5, median of 3 rounds, R = 1
# 9.47 -> 9.25 ms, R = 8 11.18 -> 10.93. On (the pingpong loop turns it off);
# MOK_KSUM_STAGED=0 turns it off.
KSUM_STAGED = experimental_switch("KSUM_STAGED", True)
# The two consumer warpgroups of a compute CTA take alternate tasks, each a whole 128 x 128
# tile, and take turns at the mainloop (kernels.megakernel_sm90's pingpong; needs the decoded
# ring; not with KSUM_STAGED). Why: the cooperative loop makes the tensor cores wait through
# every task's epilogue, signal and next-task lookup (qwen3's FC2 tiles: 0.74 ms against the
# expert path's pingpong FC2 at 0.67-0.71; 12.9-32 us per ms per CTA between tasks, run 87).
# Predicted: qwen3 3-6 % faster at one rank; 128-wide tiles read A twice as often, so long-K
# FC2 (mixtral) may lose, as it did in the expert path. Written in the eleventh session after
# its device time was spent: compile-checked only. MOK_PINGPONG=1.
PINGPONG = experimental_switch("PINGPONG", False)
# (EARLY_KSUM, the comm CTAs' k-sum of ready tokens during the GEMMs, and NARROW_FC2_TAIL,
# m64n128 wgmmas for a half-empty last FC2 N-tile, were written in the twelfth session,
# measured slower in the thirteenth and removed: docs/perf_notes.md, "Measured in the
# thirteenth session".)
# One named barrier per epilogue subtile instead of two in the GEMM tasks (the same change and
# reason as ops.ONE_EPILOGUE_BARRIER for the expert path; one env variable sets both). Written
# in the thirteenth session: MOK_ONE_EPILOGUE_BARRIER=1.
ONE_EPILOGUE_BARRIER = experimental_switch("ONE_EPILOGUE_BARRIER", False)
# With decoded tickets, the ring also carries a task's first row and its count of waits, so the
# producer's start of a task skips two dependent global loads (kernels.megakernel_sm90's
# short_task_start). Why: the recorded one-rank calls (run 96) have the megakernel's FC1 tiles
# 2-6 % slower per tile than the expert path's (a CTA's FC1 period dsv3 79.31 against 77.70 us,
# gptoss 35.55 against 33.44), and an FC1 start with gathered A waits on a chain of ~7
# dependent global loads against ~4 stages of slack. Predicted: up to ~1 us per FC1 task where
# the consumers wait for the first stage (the recorder's STAGE_WAIT spans show whether they
# do): dsv3 ~-0.9 %, gptoss ~-2 %. Measured (fourteenth session, run 102, bitwise equal;
# median of the per-round ratios of 8 interleaved rounds): qwen3 0.991, mixtral 1.002, dsv3
# 1.001, gptoss 0.984, sonic 0.993. The recorded STAGE_WAIT spans say why it gains little: a
# CTA's consumers waited for a task's first stage 3.7 us in all on dsv3 and 12 us on gptoss
# (325 and 728 waits, mean 1.5 and 2.2 us), so the FC1 tiles' per-tile gap is inside the
# mainloop, not at a task's start. On; MOK_SHORT_TASK_START=0 turns it off.
SHORT_TASK_START = experimental_switch("SHORT_TASK_START", True)
# With local rows in place, the consumers' proxy fence after a stage's wait only on FC1 tasks
# (kernels.megakernel_sm90's fence_fc1_only), whose A rows the producer warps gather by
# cp.async; FC2's and the shared expert's stages arrive by TMA and need none. Why: that fence
# (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S per k-tile) is the one difference between the
# megakernel's SASS k-loop and the expert FC1's, and it ran on every GEMM task (read in the
# fourteenth session). Measured (fifteenth session, run 110, 6 interleaved rounds, bitwise
# equal): qwen3 0.997, mixtral 1.014, dsv3 0.993, gptoss 0.985, sonic 1.014: level, so the
# fence is not what slows the megakernel's tiles. Off; MOK_FENCE_FC1_ONLY=1.
FENCE_FC1_ONLY = experimental_switch("FENCE_FC1_ONLY", False)
# With local rows in place, FC2's and the shared expert's TMA-only stages filled by the load
# warp alone, which arrives for the whole producer warpgroup (kernels.megakernel_sm90's
# warp0_tma_stages); warps 1-3 skip them instead of waiting on each stage's empty barrier.
# Why: the H200 runs both paths at its 700 W power cap (clock-event reason 0x4, SM clock
# 1400-1575 MHz of 1980), and mixtral's megakernel ran at a ~3 % lower SM clock than the expert
# path (fifteenth session, tools/clock_probe.py), its FC1 and FC2 tiles alike ~3 % slower per
# tile; the expert path's producer is one warp. Predicted: 0-1 % on mixtral, where FC2 is a
# third of the GEMM time. Measured (runs 114-115, bitwise equal): 6 interleaved rounds qwen3
# 1.003, mixtral 0.995, dsv3 1.023, gptoss 1.008, sonic 1.007; 2 s sustained, 3 rounds, mixtral
# 0.993, qwen3 0.991, dsv3 1.006, sonic 0.999, gptoss level, at unchanged clocks: level. Off;
# MOK_WARP0_TMA_STAGES=1.
WARP0_TMA_STAGES = experimental_switch("WARP0_TMA_STAGES", False)
# At one rank with no comm task, an FC1 or FC2 task's counter published only when the CTA's
# next task needs it out of the way (kernels.megakernel_sm90's defer_signals): at that task's
# start if it may wait on it (an FC2 after an FC1, a KSUM or BARRIER), else once that
# task's mainloop has issued DEFER_FLUSH_KTILES k-tiles, and at the end; the store warp then
# no longer waits for a tile's TMA
# stores to land before its warpgroup's next mainloop. Why: qwen3's cooperative FC2 tasks
# (12 k-tiles) run one every 10.98 us against ~9.7 us for the expert path's cooperative tiles
# and 8.84 for its pingpong ones (fifteenth session, run 112), ~1.3 us of task overhead over
# 8704 FC2 and 6528 FC1 tasks. Predicted, if that overhead is the store wait: qwen3 -2 to
# -4 %, dsv3 and sonic ~-1.5 %, mixtral level.
# The sixth session's DEFER_FC2_SIGNALS measured slower (run 46), in a kernel whose wgmmas no
# test checked for serialisation. Measured in the sixteenth session: flushed after the next
# whole mainloop, qwen3 1.065 x (slower: other CTAs' FC2 waited on held FC1 counters); flushed
# once the next mainloop's first k-tile is issued (the code now), level (runs 118-120: 0.985-
# 1.009; the store warp's SIGNAL phase is mostly off the critical path, the other warpgroup
# runs ahead through the loaded stages). On since the seventeenth session, flushed after 8
# k-tiles (DEFER_FLUSH_KTILES, below). MOK_DEFER_SIGNALS=0 turns it off.
DEFER_SIGNALS = experimental_switch("DEFER_SIGNALS", True)
# With DEFER_SIGNALS, the k-tiles the next mainloop issues before a held publish goes out
# (kernels.megakernel_sm90's defer_flush_ktiles; 1 = after its first, as measured level in the
# sixteenth session; a shorter mainloop publishes at its end). Why more: the store warp's wait
# for its tile's stores to land (the SIGNAL phase, ~2.1 us on qwen3) holds its warpgroup's
# wgmmas, which need all four warps; after one k-tile most of that wait is still ahead, after
# 8 (~4.4 us on qwen3's FC2) the stores have landed and the publish is about as early as
# without the deferral. Measured (seventeenth session, run 132, 6 interleaved rounds, paired
# against DEFER_SIGNALS off; flush after 1 / 4 / 8 k-tiles): qwen3 0.982 / 0.983 / **0.964**,
# dsv3 0.993 / 0.997 / 0.991, sonic 1.001 / 0.992 / 0.990, gptoss 0.998 / 1.007 / 1.011, mixtral
# 1.016 / 1.005 / 1.005 (this probe's spread: ~2 %). Recorded (run 133), qwen3's FC2 tile
# period 11.26 -> 10.67 us with FC1's unchanged (23.87 / 23.89), the layer 569 -> 579 TFLOP/s;
# gptoss FC2 31.04 -> 30.75 us. MOK_DEFER_FLUSH_KTILES=N.
DEFER_FLUSH_KTILES = experimental_setting("DEFER_FLUSH_KTILES", 8, 1, 64)
# Compute tickets by the static stride, still handed out through the ticket ring (so decoded
# words, the short task start and the deferred publish stay on: kernels.megakernel_sm90's
# strided_tickets). Why: mixtral's and gptoss's megakernel is level with the expert path on a
# cool GPU and 3-6 % behind at the 700 W cap, and it reads 57.1 GB at L2 on mixtral against
# the expert path's 38.9 for the same tiles: under dynamic tickets the tiles that share a
# weight box start microseconds apart, so the GPU cannot merge their requests before the L2
# as it does for the expert GEMMs' lockstep tiles. The bare static stride (DYNAMIC_TICKETS
# off, which also drops the decoded ring) read 45.4 GB and ran, sustained at the cap, gptoss
# 0.987, mixtral 1.007, dsv3 1.022 x the default (eighteenth session, runs 142 and 144).
# Measured with the ring (run 145: sustained 2 s per variant at the cap, 4 alternating rounds,
# bitwise equal; strided / dynamic): gptoss 0.974, mixtral 0.990, dsv3 0.995, qwen3 0.986,
# sonic 0.976, faster in all 20 rounds, at a 30-45 MHz higher SM clock. On at one rank;
# virtual ranks keep dynamic tickets (they were made for them: under the stride, virtual
# R = 8 CTAs drift apart, seventh session). STRIDED_TICKETS_VIRTUAL=1 extends it there:
# bitwise equal, but R = 8 / R = 1 went from kimi 1.150, glm 1.097, dsv4_pro 0.938 to 1.239,
# 1.201, 1.210 (runs 147-148), so off. MOK_STRIDED_TICKETS=0 turns it off.
STRIDED_TICKETS = experimental_switch("STRIDED_TICKETS", True)
STRIDED_TICKETS_VIRTUAL = experimental_switch("STRIDED_TICKETS_VIRTUAL", False)
# A compute task's counter published by its release reduction alone, without a fence.acq_rel
# before it (kernels.megakernel_sm90's release_only_publish): one MEMBAR.ALL.GPU per task
# instead of two on the store warp's way from a tile's stores to the next mainloop (its
# SIGNAL phase: 2.0-2.2 us per GEMM task, recorded in the sixteenth session). Measured level
# (run 120: 0.988-1.005 paired on the five shapes), so off. MOK_RELEASE_ONLY_PUBLISH=1.
RELEASE_ONLY_PUBLISH = experimental_switch("RELEASE_ONLY_PUBLISH", False)
# The GEMM tasks' epilogue in 128 x 64 subtiles through two 16 KB buffers instead of 128 x 32
# through four (the cooperative loop; ops.EPILOGUE_N is the same change for the expert path
# and says why). Predicted: at most half the epilogue (qwen3: 1.41 us per FC2 task, 1.82 per
# FC1 task), -1 to -3 % on qwen3, less where tiles are long (mixtral). Measured (seventeenth
# session, run 130, 6 interleaved rounds, paired against 32-column subtiles, bitwise equal):
# qwen3 1.000, mixtral 1.000, dsv3 0.990, gptoss 0.985, sonic 0.997: level. Recorded on qwen3
# (run 131): the EPILOGUE phase 1.6 -> 1.4 us but the store warp's SIGNAL wait 2.1 -> 2.2 and
# the tile periods unchanged: the stores' landing, not the subtile count, paces the task.
# Off. MOK_WIDE_EPILOGUE=1.
WIDE_EPILOGUE = experimental_switch("WIDE_EPILOGUE", False)
# 16-B vectors in flight per consumer lane in the KSUM tasks (kernels.token_ops.k_sum_unroll).
# Why more than the standalone k-sum's 8: one CTA per SM runs the KSUM tasks with its 8 consumer
# warps, one token per warp at a time, so the k-sum at the end of the call is latency-bound
# (mixtral, recorded in run 56: 512 KSUM tasks of 16 tokens, p50 16.6 us, 107 us after the
# barrier for 0.2 GB, where the expert path's k-sum kernel takes ~70 us). Measured 16 against 8
# (run 57, bitwise equal; virtual probe, alternating rounds, median of 3): R = 1 qwen3.5_397b
# 9.41 -> 8.97 ms, glm_5.2 20.31 -> 19.78; virtual R = 8 12.91 -> 12.78, 23.58 -> 22.96; one
# GPU, best of 3: sonic_120b 10.78 -> 10.46, the other four shapes within the probe's noise.
# MOK_KSUM_VECTORS=N.
KSUM_VECTORS = experimental_setting("KSUM_VECTORS", 16, 1, 64)
# Local tokens per KSUM task (tasks.build_task_list's ksum_rows; must divide TILE_M). Why a
# setting: qwen3's recorded tail (run 91) is 8 KSUM tasks of 16 tokens per CTA at ~21 us each,
# bandwidth-bound (~3.6 TB/s), plus ~30 us of overhead: 7.5 us from the last FC2 tile to the
# BARRIER, ~8 us to the first KSUM, and a ragged end of one task (~23 us between the CTAs'
# last KSUM ends). 8-token tasks would halve the ragged end: predicted ~-0.5 % on qwen3, level
# where the tail is a smaller share. Measured 8 against 16 (thirteenth session, bitwise equal,
# median of the paired per-round ratios of 8 and 10 interleaved rounds): run 95 qwen3 0.997,
# mixtral 0.986, dsv3 0.969, gptoss 0.979, sonic 0.994; run 97 0.992, 1.005, 0.969, 0.991,
# 1.005. So 8; MOK_KSUM_ROWS=16 (probe letters: h = 8, none = 16) puts back the old one.
KSUM_ROWS = experimental_setting("KSUM_ROWS", 8, 1, TILE_M)
# 16-B vectors in flight per lane in the comm CTAs' row copy, the task's rows as one flat run
# (kernels.megakernel_sm90's copy_vectors); 0 = a warp per row, 16 in flight per lane of it.
# Why: at virtual R = 8 a comm CTA moved ~22 GB/s (run 58, qwen3.5: 0.9 MB tasks in 40-43 us);
# its 12 warps then hold one row each, 8 KB in flight per warp at H = 4096. If the copy is
# latency-bound, 32 per lane doubles that and fewer comm CTAs keep up (16 -> ~8 for qwen3.5
# gives 8 SMs back to the GEMMs, ~6 %). Measured in the ninth session (run 72): bitwise equal
# (4 GPU tests: H = 512, 576, 1024; R = 2, 3, 4, 8; 16, 24, 32 vectors), but qwen3.5 at
# virtual R = 8 with 12 comm CTAs and 24 vectors ran 12.92 ms against 11.30 with 16 comm CTAs
# and the per-row copy in the same probe (13.21 with 12 and the per-row copy in run 59): a
# faster copy did not let fewer comm CTAs keep up, so off. 24 and 32 spill (60 / 380 B).
# MOK_COMM_COPY_VECTORS=N.
COMM_COPY_VECTORS = experimental_setting("COMM_COPY_VECTORS", 0, 0, 64)
ERROR_SLOTS = 8  # launches whose error word may be in flight before a call waits for the oldest
TICKETS = 2  # = kernels.megakernel_sm90.TICKETS (not imported: it needs the DSL)


@dataclasses.dataclass(frozen=True)
class PlanKey:
    num_ranks: int
    tokens: int
    hidden: int
    intermediate: int
    local_experts: int
    top_k: int
    shared_intermediate: int
    num_ctas: int
    num_comm_ctas: int
    minibatch_tokens: int
    ring_tokens: int
    timeline: bool
    timeline_capacity: int
    device: int
    copy: str = "vector"
    group: tuple | None = None  # (id(process group), handle type) for the IPC backend
    local_direct: bool = False
    fc1_lead: int = 0
    rank_blocks: bool = False
    x_in_place: bool = False  # X_IN_PLACE, decided by plan_for (one rank, local_direct)
    tile_order: str = "m_major"  # N_MAJOR_TILES: "n_major"
    local_only: bool = False  # LOCAL_ONLY_TASKS with one rank and local_direct: no comm tasks
    dynamic_tickets: bool = False  # DYNAMIC_TICKETS; over IPC only with DYNAMIC_TICKETS_IPC
    ksum_vectors: int = 16  # KSUM_VECTORS
    comm_copy_vectors: int = 0  # COMM_COPY_VECTORS (vector copy only)
    decoded_tickets: bool = False  # DECODED_TICKETS (with dynamic_tickets only)
    store_warp_signals: bool = False  # STORE_WARP_SIGNALS
    ksum_staged: bool = False  # KSUM_STAGED (not with pingpong)
    pingpong: bool = False  # PINGPONG (with decoded tickets)
    ksum_rows: int = 8  # KSUM_ROWS
    one_epilogue_barrier: bool = False  # ONE_EPILOGUE_BARRIER
    short_task_start: bool = False  # SHORT_TASK_START (with decoded tickets)
    fence_fc1_only: bool = False  # FENCE_FC1_ONLY (with local_direct)
    warp0_tma_stages: bool = False  # WARP0_TMA_STAGES (with local_direct)
    defer_signals: bool = False  # DEFER_SIGNALS (one rank, no comm task, cooperative)
    release_only_publish: bool = False  # RELEASE_ONLY_PUBLISH
    wide_epilogue: bool = False  # WIDE_EPILOGUE (the cooperative loop)
    defer_flush_ktiles: int = 1  # DEFER_FLUSH_KTILES (with defer_signals)
    strided_tickets: bool = False  # STRIDED_TICKETS (one rank; STRIDED_TICKETS_VIRTUAL; the ring)


def default_num_comm_ctas(num_peers: int, hidden: int, top_k: int, num_sms: int,
                          local_direct: bool = False, intermediate: int = 0,
                          shared_intermediate: int = 0, pingpong: bool = False) -> int:
    """With one peer and local_direct no row crosses a comm CTA: LOCAL_ONLY_COMM_CTAS (at
    least 1 with ``pingpong``: that loop runs no BARRIER, a comm CTA does).
    Otherwise the best point of the H200 sweeps on dsv3_ep8_rank and sonic_120b with every row
    copied (runs 13–17 of docs/gpu_runs.md: 4, 6, 8, 12 and 16 comm CTAs; 12 was best on both),
    raised to the split where the comm CTAs' copy time matches the compute CTAs' GEMM time
    (``comm_compute_balance``) when that needs more: shapes with little compute per routed row
    (small ``intermediate``) starve FC1 otherwise. Several ranks with local rows in place copy
    only the remote rows, and there the floor is LOCAL_DIRECT_COMM_CTAS. Measured at virtual
    R = 8 (probe medians of 3 alternating rounds, every variant bitwise equal; runs 59, 60, 63):

    | shape | balance | 10 | 12 | 16 | 20 | 24 |
    | --- | --- | --- | --- | --- | --- | --- |
    | qwen3.5_397b | 16 | | 13.21 | **11.59** | 12.07 | 12.20 |
    | glm_5.2 | 8 | **23.07** | 23.53 (23.88) | (24.55) | | |
    | kimi_k2.7 | 8 | 28.07 | **28.02** (28.28) | (28.80) | | |
    | dsv4_pro | 6 | **33.85** | 34.43 (35.22) | (35.14) | | |

    (parenthesised: run 60, the other columns run 63.) The simulator's tuner agrees at R = 1
    with local rows in place (2) and picked 8 with every row copied, measured 5.7 % slower than
    12 (docs/sim.md). EP groups over NVLink use ``tuned_config``."""
    if local_direct and num_peers == 1:
        return max(LOCAL_ONLY_COMM_CTAS, int(pingpong))
    base = max(2, min(num_sms // 4, LOCAL_DIRECT_COMM_CTAS if local_direct else DEFAULT_COMM_CTAS))
    if not intermediate:
        return base
    balance = comm_compute_balance(num_peers, hidden, intermediate, top_k, shared_intermediate,
                                   num_sms, local_direct)
    return min(num_sms // 4, max(base, balance))


COMM_CTA_GBPS = 22.0  # row bytes one comm CTA copies per second, GB (qwen3.5 R = 8, run 58)
COMPUTE_CTA_TFLOPS = 5.6  # one compute CTA's share of a ~740 TFLOP/s grouped GEMM


def comm_compute_balance(num_peers: int, hidden: int, intermediate: int, top_k: int,
                         shared_intermediate: int, num_sms: int, local_direct: bool) -> int:
    """Comm CTAs c at which copying a routed row (dispatch + combine, remote rows only with
    local_direct) on c CTAs takes as long as its GEMMs (and its share of the shared expert's)
    on num_sms - c: c = num_sms * b / (1 + b), b = copy time / compute time per CTA. The
    hidden size cancels: b grows as the intermediate size shrinks."""
    remote = (num_peers - 1) / num_peers if local_direct else 1.0
    copy_us = 2 * 2 * hidden * remote / (COMM_CTA_GBPS * 1e3)
    compute_us = 6 * hidden * (intermediate + shared_intermediate / top_k) / (COMPUTE_CTA_TFLOPS * 1e6)
    b = copy_us / compute_us
    return math.ceil(num_sms * b / (1 + b))


def fc1_lead_minibatches(compute_ctas: int, tiles_per_minibatch: int, fc1_n_tiles: int) -> int:
    """The FC1 lead L (``FC1_LEAD``): the fewest minibatches whose FC1 tiles fill every compute
    CTA, so the CTAs taking a minibatch's FC2 tickets find its FC1 tiles already done."""
    per_minibatch = max(1, tiles_per_minibatch * fc1_n_tiles)
    return -(-compute_ctas // per_minibatch)


def tuned_config(config: MoKConfig, num_peers: int, tokens: int, hidden: int,
                 intermediate: int, num_experts: int, top_k: int, shared_intermediate: int,
                 profile: str = "h200_hgx") -> MoKConfig:
    """``config`` with its ``None`` tuning fields (num_comm_sms, minibatch_tokens, ring_tokens)
    filled by the simulator's tuner (``mok_cute.sim.tune.resolve_config``) for an EP group of
    ``num_peers`` GPUs over NVLink; fields the caller set are kept and held fixed. Used on the
    IPC path, where no sweep has been measured yet (two GPUs only, at 12 comm CTAs:
    docs/gpu_runs.md run 27). Cached per shape (1-5 s for a new one)."""
    from mok_cute.sim import SimShape, tune

    shape = SimShape("plan", tokens, hidden, intermediate, num_experts, top_k, shared_intermediate)
    return tune.resolve_config(config, shape, num_peers, profile)


def resolve_sizes(config: MoKConfig, capacity: int, tokens: int) -> tuple[int, int]:
    """(minibatch_tokens, ring_tokens): explicit values are checked, None picks defaults
    (minibatch of 8 tiles; a ring that holds every row, so nothing wraps)."""
    tile = config.tile_m
    minibatch = config.minibatch_tokens or min(capacity, 8 * tile)
    ring = config.ring_tokens or capacity
    for name, value in (("minibatch_tokens", minibatch), ("ring_tokens", ring)):
        if value % tile:
            raise ValueError(f"MoKConfig.{name} must be a multiple of tile_m={tile}, got {value}")
    if ring < minibatch:
        raise ValueError(f"MoKConfig.ring_tokens must be >= minibatch_tokens={minibatch}, got {ring}")
    return min(minibatch, capacity), min(ring, capacity)


class _VirtualSide:
    """R virtual ranks in one launch (``comm.virtual``): one allocation, the [R, R] table."""

    scope = "gpu"

    def __init__(self, k: PlanKey, dev: torch.device):
        from mok_cute.comm import VirtualPeers, moe_symmetric_layout

        self.peers = VirtualPeers(k.num_ranks, moe_symmetric_layout(k.tokens, k.hidden, k.top_k,
                                                                    k.num_ranks), device=dev)
        self.layout = self.peers.layout
        self.launch_ranks = self.num_peers = k.num_ranks
        self.rank_base = 0
        self.peer_bases = self.peers.bases_matrix()
        self.own_base = self.peers.addresses[0]  # rank 0's symmetric buffer (host copy of the table)
        bf16 = self.peers.buffer.view(torch.bfloat16)
        # x of every rank as one (R, T, H) view of the symmetric buffer
        self.x = bf16.as_strided((k.num_ranks, k.tokens, k.hidden),
                                 (self.peers.nbytes // 2, k.hidden, 1), self.layout.offset("x") // 2)
        self.local_experts = k.local_experts

    def schedules(self, ids: torch.Tensor):
        """Every virtual rank's receive schedule, stacked (the GPU build: one pair of launches
        for all R)."""
        from mok_cute.schedule import build_receive_schedules

        return build_receive_schedules(ids, self.local_experts, TILE_M, validate=False)


class _IpcSide:
    """One rank of a process group (``comm.ipc``): this process's launch covers its own rank;
    the peers' buffers are mapped into it and their flags are read at system scope."""

    scope = "sys"

    def __init__(self, k: PlanKey, dev: torch.device, group, handle_type: str):
        import torch.distributed as dist

        from mok_cute.comm import IpcPeers, moe_symmetric_layout

        self.group = group
        self.num_peers = dist.get_world_size(group)
        self.peers = IpcPeers(group, moe_symmetric_layout(k.tokens, k.hidden, k.top_k,
                                                          self.num_peers),
                              handle_type, device=dev)
        self.layout = self.peers.layout
        self.launch_ranks = 1
        self.rank_base = self.peers.rank
        self.peer_bases = self.peers.table.bases.unsqueeze(0).contiguous()
        self.own_base = self.peers.table.addresses[self.rank_base]
        self.x = self.peers.view("x").unsqueeze(0)
        self.local_experts = k.local_experts

    def schedules(self, ids: torch.Tensor):
        """All-gather the routing (an NCCL collective on the stream: no host sync), then this
        rank's receive schedule (stacked, one rank)."""
        import torch.distributed as dist

        from mok_cute.schedule import build_receive_schedules

        gathered = [torch.empty_like(ids[0]) for _ in range(self.num_peers)]
        dist.all_gather(gathered, ids[0].contiguous(), group=self.group)
        return build_receive_schedules(torch.stack(gathered), self.local_experts, TILE_M,
                                       first_rank=self.rank_base, count=1, validate=False)


class Plan:
    """Everything one shape needs: peer buffers (virtual or IPC), rings, the encoded task list
    and the compiled kernel. ``R`` below is the number of ranks in this launch."""

    def __init__(self, key: PlanKey, side):
        from mok_cute.schedule import schedule_capacity

        self.key = k = key
        self.side = side
        dev = torch.device("cuda", k.device)
        self.capacity = schedule_capacity(side.num_peers, k.tokens, k.top_k, k.local_experts, TILE_M)
        layout = side.layout
        self.x_all = side.x
        self.own_base, self.x_offset = side.own_base, layout.offset("x")
        self._x_offset = self.x_offset  # as held in scalars[3]
        self.task_list = tasks_mod.build_static(
            self.capacity, hidden=k.hidden, intermediate=k.intermediate, num_tokens=k.tokens,
            top_k=k.top_k, minibatch_tokens=k.minibatch_tokens, ring_tokens=k.ring_tokens,
            shared_intermediate=k.shared_intermediate, num_ranks=side.num_peers,
            fc1_tile_n=task_tile_n(k.pingpong), fc2_tile_n=task_tile_n(k.pingpong),
            fc1_lead=k.fc1_lead, ksum_rows=k.ksum_rows,
            comm_tasks=not k.local_only, tile_order=k.tile_order,
            barrier_in_compute=k.num_comm_ctas == 0)
        if k.ksum_staged and not self.task_list.ksum_closes_compute_queue():
            # every rank's list has this one's structure, so one check covers the launch
            raise RuntimeError("ksum_staged needs every compute task after the first KSUM to be "
                               "a KSUM (the k-sum reuses the GEMM stage buffers)")
        self.device_tasks = tasks_mod.encode_device(self.task_list, device=dev)
        R, C = side.launch_ranks, k.ring_tokens
        self.ring_x = torch.empty(R, C, k.hidden, dtype=torch.bfloat16, device=dev)
        self.ring_h = torch.empty(R, C, k.intermediate, dtype=torch.bfloat16, device=dev)
        self.ring_y = torch.empty(R, C, k.hidden, dtype=torch.bfloat16, device=dev)
        self.shared_h = self.shared_y = None
        if k.shared_intermediate:
            self.shared_h = torch.empty(R, k.tokens, k.shared_intermediate, dtype=torch.bfloat16, device=dev)
            self.shared_y = torch.empty(R, k.tokens, k.hidden, dtype=torch.bfloat16, device=dev)
        self.peer_bases = side.peer_bases
        # per-rank task counters, then (row 0 only) the comm / compute ticket counters
        self.counters = torch.zeros(R, self.device_tasks.num_counters + TICKETS, dtype=torch.int32,
                                    device=dev)
        self.error = torch.zeros(1, dtype=torch.int64, device=dev)
        self._error_words = [torch.zeros(1, dtype=torch.int64, pin_memory=True)
                             for _ in range(ERROR_SLOTS)]
        self._pending_errors = collections.deque()  # (event, pinned word) per launch in flight
        self._next_error_word = 0
        self.timeline_buf = None
        if k.timeline:
            from mok_cute.timeline import TimelineBuffer
            self.timeline = TimelineBuffer(k.timeline_capacity, device=dev)
            self.timeline_buf = self.timeline.tensor
        # epoch (bumped on the device each call), first rank, tiles per minibatch, offsets,
        # timeout, local experts, static M-tiles, silent rank (test hook, see run())
        self.scalars = torch.tensor(
            [0, side.rank_base, k.minibatch_tokens // TILE_M, layout.offset("x"),
             layout.offset("combine"), layout.offset("barrier_flags"), 0, k.local_experts,
             self.capacity // TILE_M, -1], dtype=torch.int64, device=dev)
        self._waits = (0, -1)  # (timeout ns, silent rank) as held in scalars[6] and [9]
        self.kernel = jit.compile_kernel(
            "megakernel", jit.device_arch(dev), num_ranks=R, num_ctas=k.num_ctas,
            num_comm_ctas=k.num_comm_ctas, top_k=k.top_k, has_shared=bool(k.shared_intermediate),
            scope=side.scope, timeline=k.timeline, copy=k.copy, local_direct=k.local_direct,
            rank_blocks=k.rank_blocks, dynamic_tickets=k.dynamic_tickets,
            ksum_vectors=k.ksum_vectors, copy_vectors=k.comm_copy_vectors,
            decoded_tickets=k.decoded_tickets, store_warp_signals=k.store_warp_signals,
            ksum_staged=k.ksum_staged, pingpong=k.pingpong,
            one_epilogue_barrier=k.one_epilogue_barrier, short_task_start=k.short_task_start,
            fence_fc1_only=k.fence_fc1_only, warp0_tma_stages=k.warp0_tma_stages,
            defer_signals=k.defer_signals, release_only_publish=k.release_only_publish,
            epi_n=64 if k.wide_epilogue else 32, defer_flush_ktiles=k.defer_flush_ktiles,
            strided_tickets=k.strided_tickets)
        self._no_slot_rows = torch.full((R, 1), -1, dtype=torch.int32, device=dev)
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ one call
    def run(self, xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared, timeout_ms: float,
            out: torch.Tensor | None = None, silent_rank: int = -1) -> torch.Tensor:
        """xs (R, T, H) bf16, topk_idx (R, T, K) global ids, topk_weights (R, T, K),
        w_* (R, E_loc, ., .), shared: None or (gate, up, down) with a leading R (R = the ranks
        of this launch: all virtual ranks, or 1 for this process's rank of a group).
        ``silent_rank`` (tests only): that rank never announces its start, so every wait on
        it times out, as if its process had died."""
        k = self.key
        self._check_errors(block=False)
        R = self.side.launch_ranks
        # With no peer to read it, the caller's x is read in place (FC1's local rows, the
        # shared expert) instead of being copied into the symmetric buffer first.
        in_place = k.x_in_place and xs.is_contiguous() and xs.data_ptr() % 16 == 0  # TMA base
        x_own = xs if in_place else self.x_all
        if not in_place:
            self.x_all.copy_(xs)
        # the kernel finds this rank's x rows at peer_bases[rank][rank] + x_offset
        x_offset = xs.data_ptr() - self.own_base if in_place else self.x_offset
        if x_offset != self._x_offset:  # rewritten only when it changes
            self._x_offset = x_offset
            self.scalars[3].fill_(x_offset)
        ids = topk_idx.to(torch.int32)
        scheds = self.side.schedules(ids)  # stacked: [R, ...] per field, no copies
        slot_rows = self._no_slot_rows
        if k.local_direct:
            slot_rows = scheds.slot_rows
            if slot_rows is None:  # the torch build at R > 1 leaves it to row_of_slot
                from mok_cute.schedule import row_of_slot

                slot_rows = torch.stack([row_of_slot(scheds[r], k.tokens, k.top_k, scheds.first_rank + r)
                                         for r in range(len(scheds))])
        num_tiles = scheds.num_tiles
        self.scalars[0].add_(1)
        waits = (int(timeout_ms * 1e6), silent_rank)
        if waits != self._waits:  # rewritten only when they change: no launches per call
            self._waits = waits
            self.scalars[6].fill_(waits[0])
            self.scalars[9].fill_(waits[1])
        self.counters.zero_()
        self.error.zero_()
        if self.timeline_buf is not None:
            self.timeline.reset()
        if out is None:
            out = torch.empty(R, k.tokens, k.hidden, dtype=torch.bfloat16, device=xs.device)
        E = R * k.local_experts
        kmajor = lambda t: t.permute(1, 2, 0)  # (L, rows, K) -> (rows, K, L)  # noqa: E731
        flat = lambda w: w.reshape(E, *w.shape[2:])  # noqa: E731
        s_args = [None] * 6
        if shared is not None:
            s_args = [kmajor(x_own), kmajor(shared[0]), kmajor(shared[1]), kmajor(shared[2]),
                      kmajor(self.shared_h), kmajor(self.shared_y)]
        d = self.device_tasks
        self.kernel(
            d.tasks, d.queues, d.queue_len, d.queue_live_len, d.queue_blocks,
            d.counter_offsets, self.counters, self.error, num_tiles, scheds.tile_expert,
            scheds.row_peer, scheds.row_token, scheds.row_k, self.peer_bases,
            kmajor(self.ring_x), kmajor(self.ring_h), kmajor(self.ring_y),
            kmajor(flat(w_gate)), kmajor(flat(w_up)), kmajor(flat(w_down)), *s_args,
            topk_weights.to(torch.float32), ids, slot_rows, out, self.timeline_buf, self.scalars)
        if self.timeline_buf is not None:
            from mok_cute.timeline import set_last
            set_last(self.timeline)  # what `mok-cute timeline` decodes after the call
        word = self._error_words[self._next_error_word]
        self._next_error_word = (self._next_error_word + 1) % ERROR_SLOTS
        word.copy_(self.error, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending_errors.append((event, word))
        return out

    def raise_pending_errors(self) -> None:
        """Wait for every launch's error-word copy; raise PeerTimeoutError for the first
        launch whose bounded wait timed out."""
        self._check_errors(block=True)

    def _check_errors(self, block: bool) -> None:
        """Check the finished launches (all of them with ``block``; otherwise only those done,
        and the oldest also when every pinned word is in use)."""
        from mok_cute.kernels.common import raise_on_wait_error

        pending = self._pending_errors
        while pending:
            event, word = pending[0]
            if not (block or len(pending) >= ERROR_SLOTS or event.query()):
                break
            event.synchronize()
            pending.popleft()
            raise_on_wait_error(int(word[0]))


def ticket_position(device_tasks, role: int, R: int, live_prefix: int, rank_blocks: bool,
                    q: int, cursor: tuple[int, int]) -> tuple[int, int, tuple[int, int]]:
    """Python model of ``MegakernelSm90._ticket``: ticket ``q`` of ``role`` -> (queue position,
    or one past the queue when exhausted; rank; the updated (block, first ticket of the block)
    cursor, which only moves forward as one CTA's tickets do).

    Alternating (``rank_blocks`` False): position q // R of rank q % R, positions past the
    live prefix jumping to the tail. Blocks: ``queue_blocks`` cut each queue into one block
    per minibatch (clipped to the live prefix) and the tail; R * size tickets per block, every
    rank's share in turn (``tasks.ticket_blocks``)."""
    qlen = int(device_tasks.queue_len[role])
    blocks = device_tasks.queue_blocks[role].tolist()
    tail = blocks[-1]
    if not rank_blocks:
        pos = q // R
        if pos >= live_prefix:
            pos = tail + (pos - live_prefix)
        return pos, q % R, cursor

    def block(b):
        if b < len(blocks) - 1:
            return blocks[b], max(min(blocks[b + 1], live_prefix) - blocks[b], 0)
        return tail, qlen - tail

    b, q_base = cursor
    start, size = block(b)
    while b < len(blocks) and q >= q_base + R * size:
        q_base += R * size
        b += 1
        start, size = block(b)
    if b >= len(blocks):
        return qlen, 0, (b, q_base)
    off = q - q_base
    return start + off % size, off // size, (b, q_base)


def walk_tickets(device_tasks, num_tiles: list[int], role: int,
                 rank_blocks: bool = False) -> list[tuple[int, int, str]]:
    """Python model of how the kernel's CTAs of one role walk their tickets with
    ``len(num_tiles)`` virtual ranks (``MegakernelSm90._live_prefix``, ``_ticket``,
    ``_task_state``; the mapping is ``ticket_position``). Returns, in ticket order,
    (rank, list index, "run" | "noop" | "skip") for every ticket that names a task. Used by the
    CPU tests to check the walk against ``tasks.simulate_live_run`` per rank."""
    R = len(num_tiles)
    tpm = device_tasks.tiles_per_minibatch
    tasks_np = device_tasks.tasks.cpu().numpy()
    queues = device_tasks.queues.cpu().numpy()
    qlen = int(device_tasks.queue_len[role])
    live_len = device_tasks.queue_live_len.cpu().numpy()
    live_of = [-(-int(t) // tpm) for t in num_tiles]
    live_prefix = max(int(live_len[role, live]) for live in live_of)
    out, q, cursor = [], 0, (0, 0)
    while True:
        pos, rank, cursor = ticket_position(device_tasks, role, R, live_prefix, rank_blocks, q, cursor)
        if pos >= qlen:
            break
        index = int(queues[role, pos])
        minibatch, m_tile = int(tasks_np[index, 2]), int(tasks_np[index, 3])
        if minibatch >= live_of[rank]:
            state = "skip"
        elif minibatch >= 0 and m_tile >= num_tiles[rank]:
            state = "noop"
        else:
            state = "run"
        out.append((rank, index, state))
        q += 1
    return out


_PLANS: dict[PlanKey, Plan] = {}
_PLANS_LOCK = threading.Lock()


def task_tile_n(pingpong: bool) -> int:
    """Output columns of an FC1 (half gate, half up) or FC2 task: 128 with pingpong, else 256."""
    return PINGPONG_TILE_N if pingpong else TASK_TILE_N


def release_plans() -> None:
    """Drop every cached plan (its rings, counters and symmetric buffers go with it once no
    call holds them): benchmarks call it between shapes."""
    with _PLANS_LOCK:
        _PLANS.clear()


def plan_for(xs, w_gate, w_down, shared, topk_idx, config: MoKConfig, group=None,
             handle_type: str = "posix_fd") -> Plan:
    """The cached plan for these shapes: R virtual ranks (``group=None``, xs [R, T, H]) or this
    process's rank of ``group`` (xs [1, T, H], peers over IPC)."""
    from mok_cute.schedule import schedule_capacity

    R, T, H = xs.shape
    E_loc, I = w_gate.shape[1], w_gate.shape[2]
    K = topk_idx.shape[-1]
    if H % 64 or I % 64:
        raise ValueError(f"the megakernel needs hidden and intermediate sizes that are multiples "
                         f"of 64, got H={H}, I={I}")
    Is = shared[0].shape[-2] if shared is not None else 0
    if Is % 64:
        raise ValueError(f"shared expert intermediate size must be a multiple of 64, got {Is}")
    device = xs.device.index if xs.device.index is not None else torch.cuda.current_device()
    num_sms = _num_sms(device)
    peers = R
    if group is not None:
        import torch.distributed as dist

        peers = dist.get_world_size(group)
    if group is not None and peers > 1:  # GPUs over NVLink: the simulator's picks
        config = tuned_config(config, peers, T, H, I, peers * E_loc, K, Is)
    capacity = schedule_capacity(peers, T, K, E_loc, TILE_M)
    minibatch, ring = resolve_sizes(config, capacity, T)
    local_direct = LOCAL_DIRECT and COMM_COPY == "vector" and ring >= capacity
    # one GPU (one rank, or virtual ranks sharing its HBM): the measured defaults
    local_only = LOCAL_ONLY_TASKS and local_direct and peers == 1  # no comm tasks
    dynamic = DYNAMIC_TICKETS and (group is None or DYNAMIC_TICKETS_IPC)
    decoded = dynamic and DECODED_TICKETS
    pingpong = PINGPONG and decoded
    num_comm = config.num_comm_sms
    if num_comm is None:
        num_comm = default_num_comm_ctas(peers, H, K, num_sms, local_direct, I, Is, pingpong)
    if num_comm >= num_sms:
        raise ValueError(f"MoKConfig.num_comm_sms must be < the SM count {num_sms}, got {num_comm}")
    if num_comm == 0 and (not local_only or pingpong):
        raise ValueError(
            "MoKConfig.num_comm_sms=0 needs one rank reading its own rows in place (no comm "
            "task: one GPU, no group, a ring that holds every routed row) and the cooperative "
            f"loop; this call has {peers} rank(s), rows in place {local_direct}, "
            f"pingpong {pingpong}")
    fc1_lead = 0
    if FC1_LEAD:
        fc1_lead = FC1_LEAD_MINIBATCHES
        if fc1_lead is None:
            fc1_lead = fc1_lead_minibatches(num_sms - num_comm, minibatch // TILE_M,
                                            -(-2 * I // task_tile_n(pingpong)))
    defer = (DEFER_SIGNALS and local_only and R == 1 and decoded and STORE_WARP_SIGNALS
             and not pingpong)
    strided = (STRIDED_TICKETS and dynamic and group is None
               and (R == 1 or STRIDED_TICKETS_VIRTUAL))
    key = PlanKey(R, T, H, I, E_loc, K, Is, num_sms, num_comm, minibatch, ring,
                  config.timeline, config.timeline_capacity, device, COMM_COPY,
                  None if group is None else (id(group), handle_type), local_direct, fc1_lead,
                  RANK_BLOCKS and R > 1, X_IN_PLACE and local_direct and peers == 1,
                  "n_major" if N_MAJOR_TILES else "m_major",
                  local_only, dynamic, KSUM_VECTORS,
                  COMM_COPY_VECTORS if COMM_COPY == "vector" else 0, decoded,
                  STORE_WARP_SIGNALS, KSUM_STAGED and not pingpong, pingpong,
                  KSUM_ROWS, ONE_EPILOGUE_BARRIER, SHORT_TASK_START and decoded,
                  FENCE_FC1_ONLY and local_direct, WARP0_TMA_STAGES and local_direct,
                  defer, RELEASE_ONLY_PUBLISH, WIDE_EPILOGUE and not pingpong,
                  DEFER_FLUSH_KTILES if defer else 1, strided)
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is None:
            dev = torch.device("cuda", device)
            side = _VirtualSide(key, dev) if group is None else _IpcSide(key, dev, group, handle_type)
            plan = _PLANS[key] = Plan(key, side)
    return plan


def moe_forward_virtual(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                        config: MoKConfig | None = None) -> torch.Tensor:
    """The megakernel on R virtual ranks (inputs already validated by ``mok_cute.api``)."""
    config = config or MoKConfig()
    plan = plan_for(xs, w_gate, w_down, shared, topk_idx, config)
    with plan.lock:
        return plan.run(xs, topk_idx, topk_weights, w_gate, w_up, w_down, shared,
                        config.timeout_ms)


def moe_forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared=None,
                config: MoKConfig | None = None, group=None,
                handle_type: str = "posix_fd") -> torch.Tensor:
    """One GPU (``group=None``): the megakernel with one rank. With ``group``: this process's
    rank of an expert-parallel group, peers reached through IPC-mapped symmetric buffers
    (every rank of the group calls together, with the same T). The IPC launch has run on 2
    H200s (docs/gpu_runs.md, runs 25–27), not yet on 4 or 8; its unset comm split, minibatch
    and ring come from the simulator's tuner (``tuned_config``)."""
    config = config or MoKConfig()
    sh = None if shared is None else tuple(w.unsqueeze(0) for w in shared)
    args = (x.unsqueeze(0), topk_idx.unsqueeze(0), topk_weights.unsqueeze(0),
            w_gate.unsqueeze(0), w_up.unsqueeze(0), w_down.unsqueeze(0))
    if group is None:
        return moe_forward_virtual(*args, sh, config)[0]
    plan = plan_for(args[0], args[3], args[5], sh, args[1], config, group, handle_type)
    with plan.lock:
        return plan.run(*args, sh, config.timeout_ms)[0]


def raise_pending_errors() -> None:
    """Check every plan's last launch for a timed-out wait (PeerTimeoutError)."""
    for plan in list(_PLANS.values()):
        plan.raise_pending_errors()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
