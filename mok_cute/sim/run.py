"""``simulate()``: one layer call of an EP group, and what comes out of it.

Outputs (``SimResult``): per task (rank, SM, take / start / end, type); ``summary()`` (busy,
wait and idle per role, dispatch / combine GB/s, GEMM TFLOP/s, exposed communication, layer
time and TFLOP/s per GPU by MoK's formula); ``timeline()`` turns chosen ranks into a
``mok_cute.timeline.Timeline`` (the recorder's record format), so the Chrome trace and the PNG
swimlane come from the same exporters as real recordings (``write_trace``, ``write_png``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from ..tasks import Role, TaskType
from .engine import SimRecords, run_graph
from .hardware import HardwareProfile, get_profile
from .model import Graph, Routing, SimConfig, SimShape, build_graph

__all__ = ["simulate", "SimResult"]

_COMM_TYPES = (TaskType.DISPATCH, TaskType.COMBINE, TaskType.BARRIER)
_COMPUTE_TYPES = (TaskType.FC1, TaskType.FC2, TaskType.SHARED_FC1, TaskType.SHARED_FC2,
                  TaskType.KSUM)
_GEMM_TYPES = (TaskType.FC1, TaskType.FC2, TaskType.SHARED_FC1, TaskType.SHARED_FC2)


def simulate(shape: SimShape | str, num_ranks: int, config: SimConfig,
             profile: HardwareProfile | str = "h200_hgx", routing: Routing = Routing(), *,
             symmetric: bool = False, dispatch_only: bool = False,
             topk_idx: np.ndarray | None = None) -> SimResult:
    """Simulate one layer call on every rank of an EP group of ``num_ranks`` GPUs."""
    hw = get_profile(profile)
    if isinstance(shape, str):
        shape = SimShape.named(shape)
    t0 = time.perf_counter()
    g = build_graph(shape, num_ranks, routing, config, hw, symmetric=symmetric,
                    dispatch_only=dispatch_only, topk_idx=topk_idx)
    t1 = time.perf_counter()
    rec = run_graph(g, hw)
    t2 = time.perf_counter()
    return SimResult(graph=g, records=rec, shape=shape, config=config, hw=hw, routing=routing,
                     num_ranks=num_ranks, wall_s=dict(build=t1 - t0, run=t2 - t1))


def _union_length(s: np.ndarray, e: np.ndarray) -> float:
    u = _intervals_union(s, e)
    return float((u[:, 1] - u[:, 0]).sum()) if u.size else 0.0


def _intervals_union(s, e):
    if s.size == 0:
        return np.zeros((0, 2))
    o = np.argsort(s, kind="stable")
    s, e = s[o], e[o]
    run_end = np.maximum.accumulate(e)
    new = np.concatenate([[True], s[1:] > run_end[:-1]])
    seg = np.cumsum(new) - 1
    out = np.empty((seg[-1] + 1, 2))
    out[:, 0] = s[new]
    out[:, 1] = -np.inf
    np.maximum.at(out[:, 1], seg, e)
    return out


def _minus_length(a: np.ndarray, b: np.ndarray) -> float:
    """Length of union(a) minus union(b), both disjoint sorted interval arrays."""
    total = float((a[:, 1] - a[:, 0]).sum()) if a.size else 0.0
    if not a.size or not b.size:
        return total
    # intersection length via sweeping merged boundaries
    inter = 0.0
    i = j = 0
    while i < len(a) and j < len(b):
        lo = max(a[i, 0], b[j, 0])
        hi = min(a[i, 1], b[j, 1])
        if hi > lo:
            inter += hi - lo
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return total - inter


@dataclasses.dataclass
class SimResult:
    graph: Graph
    records: SimRecords
    shape: SimShape
    config: SimConfig
    hw: HardwareProfile
    routing: Routing
    num_ranks: int
    wall_s: dict

    # ---- headline numbers ----------------------------------------------------------------
    @property
    def rank_times(self) -> np.ndarray:
        """End of each simulated rank's last task (s)."""
        g = self.graph
        R = 1 if g.symmetric else g.num_ranks
        out = np.zeros(R)
        np.maximum.at(out, g.rank, self.records.end)
        return out

    @property
    def layer_time(self) -> float:
        return float(self.rank_times.max())

    @property
    def tflops_per_gpu(self) -> float:
        """MoK's formula 6*(T*K + T*[shared])*H*I per rank over the layer time (max over
        ranks), in TFLOP/s."""
        return self.shape.layer_flops() / self.layer_time / 1e12

    def summary(self) -> dict:
        g, rec = self.graph, self.records
        R = 1 if g.symmetric else g.num_ranks
        span = self.layer_time
        n_comm, n_comp = g.num_comm_sms, g.num_compute_sms
        ty = g.type
        out = dict(
            shape=self.shape.name, profile=self.hw.name, num_ranks=self.num_ranks,
            routing=self.routing.label, dispatch=self.config.dispatch,
            precision=self.config.precision, num_comm_sms=n_comm,
            minibatch_tokens=self.config.minibatch_tokens, ring_tokens=self.config.ring_tokens,
            symmetric=g.symmetric,
            layer_time_us=span * 1e6, tflops_per_gpu=self.tflops_per_gpu,
            rank_time_us_min=float(self.rank_times.min() * 1e6),
        )
        busy = rec.end - rec.start
        wait = rec.start - rec.take
        for ro, nsm, name in ((Role.COMM, n_comm, "comm"), (Role.COMPUTE, n_comp, "compute")):
            m = g.role == ro
            tot = nsm * R * span
            out[f"{name}_busy_pct"] = 100.0 * busy[m].sum() / tot
            out[f"{name}_wait_pct"] = 100.0 * wait[m].sum() / tot
            out[f"{name}_idle_pct"] = 100.0 - out[f"{name}_busy_pct"] - out[f"{name}_wait_pct"]
        # per-rank windows
        disp_gbps, disp_link_gbps, comb_gbps, gemm_tf, exposed = [], [], [], [], []
        for r in range(R):
            mr = g.rank == r
            for tt, lst, lst_link in ((TaskType.DISPATCH, disp_gbps, disp_link_gbps),
                                      (TaskType.COMBINE, comb_gbps, None)):
                m = mr & (ty == tt) & (g.comm_bytes > 0)
                if m.any():
                    win = _union_length(rec.start[m], rec.end[m])
                    if win > 0:
                        lst.append(g.comm_bytes[m].sum() / win / 1e9)
                        if lst_link is not None:
                            lst_link.append(g.link_bytes[m].sum() / win / 1e9)
            m = mr & np.isin(ty, _GEMM_TYPES)
            if m.any():
                gemm_tf.append(g.flops[m].sum() / _union_length(rec.start[m], rec.end[m]) / 1e12)
            mc = mr & np.isin(ty, _COMM_TYPES)
            mk = mr & np.isin(ty, _COMPUTE_TYPES)
            exposed.append(_minus_length(_intervals_union(rec.start[mc], rec.end[mc]),
                                         _intervals_union(rec.start[mk], rec.end[mk])))
        out["dispatch_gbps"] = float(np.mean(disp_gbps)) if disp_gbps else None
        out["dispatch_link_gbps"] = float(np.mean(disp_link_gbps)) if disp_link_gbps else None
        out["combine_gbps"] = float(np.mean(comb_gbps)) if comb_gbps else None
        out["gemm_tflops"] = float(np.mean(gemm_tf)) if gemm_tf else None
        out["exposed_comm_pct"] = 100.0 * float(np.mean(exposed)) / span if span else 0.0
        out["exposed_comm_pct_max"] = 100.0 * float(np.max(exposed)) / span if span else 0.0
        out["wall_s"] = {k: round(v, 3) for k, v in self.wall_s.items()}
        return out

    def dispatch_stats(self) -> dict:
        """Dispatch-only bandwidth: makespan, link bytes and NVLink utilisation."""
        g, rec = self.graph, self.records
        m = g.type == TaskType.DISPATCH
        if not m.any():
            return {}
        t0 = float(rec.start[m].min())
        R = 1 if g.symmetric else g.num_ranks
        recv = g.receiver[m] if not g.symmetric else np.zeros(int(m.sum()), dtype=np.int64)
        recv_end = np.zeros(R)
        np.maximum.at(recv_end, recv, rec.end[m])
        recv_link = np.bincount(recv, weights=g.link_bytes[m], minlength=R)
        makespan = float(recv_end.max()) - t0
        link = float(g.link_bytes[m].sum())
        per_rank_gbps = recv_link / np.maximum(recv_end - t0, 1e-12) / 1e9
        return dict(
            makespan_us=makespan * 1e6,
            link_bytes=link,
            # aggregate link bytes over the group's makespan
            link_gbps_per_gpu=link / R / makespan / 1e9,
            nvlink_utilisation=link / (R * makespan * self.hw.link_bytes_per_s),
            # each receiver's ingress bytes over its own dispatch time (a per-GPU dispatch
            # benchmark's number), averaged over receivers
            mean_receiver_gbps=float(per_rank_gbps.mean()),
            mean_receiver_finish_us=float((recv_end - t0).mean()) * 1e6,
            hot_receiver_gbps=float(per_rank_gbps[int(np.argmax(recv_link))]),
        )

    # ---- timeline views ------------------------------------------------------------------
    def timeline(self, ranks=None):
        """A ``mok_cute.timeline.Timeline`` of the chosen ranks (default: rank 0 and the
        slowest rank), with WAIT records for the time SMs spun on a counter."""
        from .. import timeline as tlmod

        g, rec = self.graph, self.records
        if ranks is None:
            rt = self.rank_times
            ranks = sorted({0, int(np.argmax(rt))})
        sel = np.flatnonzero(np.isin(g.rank, list(ranks)))
        ns = lambda a: np.round(a * 1e9).astype(np.int64)  # noqa: E731
        task_id = np.where(g.local_id[sel] >= 0, g.local_id[sel], sel)
        w = sel[rec.start[sel] > rec.take[sel] + 1e-12]
        wf = rec.waited_for[w]
        wid = np.where(wf >= 0, np.where(g.local_id[np.maximum(wf, 0)] >= 0,
                                         g.local_id[np.maximum(wf, 0)], wf), -1)
        n = sel.size + w.size
        out = np.zeros(n, dtype=tlmod.RECORD_DTYPE)
        out["role"][:sel.size] = g.role[sel]
        out["task_type"][:sel.size] = g.type[sel]
        out["task_id"][:sel.size] = task_id
        out["rank"][:sel.size] = g.rank[sel]
        out["sm_id"][:sel.size] = rec.sm[sel]
        out["cta_id"][:sel.size] = rec.sm[sel]
        out["start_ns"][:sel.size] = ns(rec.start[sel])
        out["end_ns"][:sel.size] = ns(rec.end[sel])
        k = slice(sel.size, n)
        out["role"][k] = g.role[w]
        out["task_type"][k] = int(TaskType.WAIT)
        out["task_id"][k] = wid
        out["rank"][k] = g.rank[w]
        out["sm_id"][k] = rec.sm[w]
        out["cta_id"][k] = rec.sm[w]
        out["start_ns"][k] = ns(rec.take[w])
        out["end_ns"][k] = ns(rec.start[w])
        out = out[np.argsort(out["start_ns"], kind="stable")]
        meta = dict(source="mok_cute.sim (simulated, not measured)", shape=self.shape.name,
                    profile=self.hw.name, num_ranks=self.num_ranks,
                    routing=self.routing.label, dispatch=self.config.dispatch,
                    precision=self.config.precision, num_comm_sms=self.config.num_comm_sms,
                    minibatch_tokens=self.config.minibatch_tokens,
                    ring_tokens=self.config.ring_tokens)
        return tlmod.Timeline(records=out, capacity=n, written=n, dropped=0, t0_ns=0, meta=meta)

    def write_trace(self, path, ranks=None) -> Path:
        from .. import timeline as tlmod

        return tlmod.write_chrome_trace(self.timeline(ranks), path)

    def write_png(self, path, rank: int | None = None, title: str | None = None) -> Path:
        from .. import timeline as tlmod

        if rank is None:
            rank = int(np.argmax(self.rank_times))
        s = self.summary()
        fp8 = " fp8" if self.config.precision == "fp8" else ""
        title = title or (f"SIMULATED {self.shape.name}{fp8} on {self.hw.name} R={self.num_ranks} "
                          f"{self.config.dispatch} {self.routing.label}, rank {rank}, "
                          f"{self.config.num_comm_sms} comm SMs, mb {self.config.minibatch_tokens}"
                          f": {s['tflops_per_gpu']:.0f} TFLOP/s")
        return tlmod.plot_swimlanes(self.timeline([rank]), path, title=title)
