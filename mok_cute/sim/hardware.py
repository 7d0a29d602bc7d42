"""Hardware profiles for the simulator. Every rate names its source.

A profile is one GPU of an NVLink domain plus the domain size. The fabric model is an NVSwitch
fabric: non-blocking inside, so the only shared link resources are each GPU's port, one
capacity for egress and one for ingress (``link_bytes_per_s`` each, per direction). Transfers
share a port max-min fairly (per SM); each comm SM moves at most ``sm_copy_bytes_per_s``.

Source tags used below:
- ``anchors``: /work/shared/notes/anchors.md (measured on our H200s, or a datasheet line there);
- ``datasheet``: the vendor's published figure, as quoted;
- ``assumption``: no measurement yet; the study docs list what measurement would replace it;
- ``measured``: fitted by ``mok_cute.bench.calibrate`` to records of our own kernels committed in
  ``benchmarks/results/`` (the source names the file, the runs and the fit; a test refits it), or
  a benchmark of our own kernels committed there (the source names the file and the command).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["HardwareProfile", "PROFILES", "get_profile", "profile_for_device", "RATE_FIELDS"]

# Fields that are rates or costs and must carry a source.
RATE_FIELDS = (
    "num_gpus",
    "num_sms",
    "sm_tensor_flops",
    "sm_fp8_tensor_flops",
    "hbm_bytes_per_s",
    "link_bytes_per_s",
    "link_peak_bytes_per_s",
    "sm_copy_bytes_per_s",
    "gemm_task_overhead_s",
    "comm_task_overhead_s",
    "barrier_latency_s",
)
# Optional cost fields: may be None (see HardwareProfile.comm_task_serial_s); carry a source
# when set.
OPTIONAL_FIELDS = ("comm_task_serial_s",)


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    num_gpus: int  # GPUs in one NVLink domain
    num_sms: int  # SMs per GPU
    sm_tensor_flops: float  # achievable dense bf16 FLOP/s of one SM's tensor cores
    # achievable e4m3 FLOP/s of one SM with 1 x 128 / 128 x 128 block scales (promotion included):
    # the rate of MoKConfig(precision="fp8")'s routed FC1 / FC2 tasks
    sm_fp8_tensor_flops: float
    hbm_bytes_per_s: float  # achievable HBM bandwidth per GPU
    link_bytes_per_s: float  # achievable NVLink bandwidth per GPU per direction (port capacity)
    link_peak_bytes_per_s: float  # datasheet NVLink bandwidth per GPU per direction
    sm_copy_bytes_per_s: float  # how fast one comm SM moves data (pull or push)
    gemm_task_overhead_s: float  # fixed cost of one GEMM tile task (pipeline fill, epilogue)
    comm_task_overhead_s: float  # fixed cost of one comm task (counter wait, flag, latency)
    barrier_latency_s: float  # cross-rank flag round trip of the group barrier
    # The part of ``comm_task_overhead_s`` spent before the task's flow starts (ticket,
    # counter check, record write). The rest, ``comm_latency_s``, is per-row latency that a
    # copy overlaps with its transfers: the engine spends it *during* the flow by capping the
    # task's per-SM rate at ``bytes / (bytes / sm_copy_bytes_per_s + comm_latency_s)``, so an
    # isolated task still takes ``comm_task_overhead_s + bytes / sm_copy_bytes_per_s`` but
    # the link is not idle while many comm SMs sit in their latency. None: all of the
    # overhead is serial (the engine's behaviour before this field).
    comm_task_serial_s: float | None = None
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))
        for f in RATE_FIELDS:
            v = getattr(self, f)
            ok = v >= 0 if f.endswith("_s") else v > 0  # costs may be 0, rates may not
            if not ok:
                raise ValueError(f"HardwareProfile.{f} must be {'>=' if f.endswith('_s') else '>'}"
                                 f" 0, got {v!r}")
        if self.comm_task_serial_s is not None and not self.comm_task_serial_s >= 0:
            raise ValueError(f"HardwareProfile.comm_task_serial_s must be None or >= 0, got "
                             f"{self.comm_task_serial_s!r}")

    @property
    def comm_serial_s(self) -> float:
        """Serial part of a comm task's fixed cost (before its flow): ``comm_task_serial_s``
        clipped to ``comm_task_overhead_s``, or all of it when that is None."""
        ov = self.comm_task_overhead_s
        return ov if self.comm_task_serial_s is None else min(self.comm_task_serial_s, ov)

    @property
    def comm_latency_s(self) -> float:
        """Part of a comm task's fixed cost overlapped with its flow (per-row latency)."""
        return self.comm_task_overhead_s - self.comm_serial_s

    def comm_flow_cap(self, nbytes: float) -> float:
        """Per-SM rate cap of a comm flow of ``nbytes``: the copy rate with the task's
        latency spread over its bytes (Little's law: the rows in flight cover the latency)."""
        lat = self.comm_latency_s
        if lat <= 0.0 or nbytes <= 0.0:
            return self.sm_copy_bytes_per_s
        return nbytes / (nbytes / self.sm_copy_bytes_per_s + lat)

    @property
    def gpu_tensor_flops(self) -> float:
        return self.sm_tensor_flops * self.num_sms

    def replace(self, *, source: str | None = None, **changes) -> HardwareProfile:
        """A copy with some fields changed; ``source`` names where the new values come from
        (required for rate fields, e.g. "calibrated: benchmarks/results/x.json")."""
        rates = [k for k in changes if k in RATE_FIELDS or k in OPTIONAL_FIELDS]
        if rates and not source:
            raise ValueError(f"source must name where the new {rates} come from")
        sources = dict(self.sources)
        for k in rates:
            sources[k] = source
        return dataclasses.replace(self, sources=sources, **changes)

    def describe_sources(self) -> list[tuple[str, object, str]]:
        return [(f, getattr(self, f), self.sources.get(f, "")) for f in RATE_FIELDS] + [
            (f, getattr(self, f), self.sources.get(f, "")) for f in OPTIONAL_FIELDS
            if getattr(self, f) is not None]


_H200_DATASHEET_BF16 = 989e12  # anchors: "The datasheet dense bf16 figure is 989 TFLOP/s"
_H200_CUBLAS_BF16 = 723e12  # anchors: "cuBLAS bf16 8192^3 | 723 TFLOP/s" (measured H200)
_ACHIEVED_FRACTION = _H200_CUBLAS_BF16 / _H200_DATASHEET_BF16  # 0.731
# benchmarks/results/2026-12-01_05_probes.json [2026-12-02_h200_fp8_gemm_probe]: our FP8 grouped FC1, 128 x 256 tiles
_H200_FP8_GROUPED_FC1 = 1079e12
_H200_LINK_FRACTION = 395e9 / 450e9  # measured peer copy over datasheet NVLink4, 0.878
_H200_HBM_FRACTION = 4.22e12 / 4.8e12  # measured device copy over datasheet HBM3e, 0.879

H200_HGX = HardwareProfile(
    name="h200_hgx",
    description="HGX H200: 8 GPUs on NVSwitch (NVLink 4), 132 SMs each",
    num_gpus=8,
    num_sms=132,
    sm_tensor_flops=_H200_CUBLAS_BF16 / 132,
    sm_fp8_tensor_flops=_H200_FP8_GROUPED_FC1 / 132,
    hbm_bytes_per_s=4.22e12,
    link_bytes_per_s=395e9,
    link_peak_bytes_per_s=450e9,
    # calibrate.fit_megakernel_comm("run16_bulk"): 87.86 GB/s, 31.92 us + 1.70 us gap
    sm_copy_bytes_per_s=87.9e9,
    gemm_task_overhead_s=1.5e-6,
    comm_task_overhead_s=33.6e-6,
    barrier_latency_s=5.0e-6,
    comm_task_serial_s=1.7e-6,
    sources={
        "num_gpus": "datasheet: HGX H200 8-GPU board, one NVSwitch domain",
        "num_sms": "anchors: Physical limits, H200 SMs 132",
        "sm_tensor_flops": "anchors: cuBLAS bf16 8192^3 723 TFLOP/s measured on one H200, / 132 SMs",
        "sm_fp8_tensor_flops": "measured: our FP8 grouped GEMM on dsv3_ep8_rank, 128 x 256 tiles, "
                               "1 x 128 / 128 x 128 scales promoted every 128 K (python "
                               "tools/fp8_gemm_probe.py, benchmarks/results/2026-12-02_h200_fp8_"
                               "gemm_probe.json, 3 rounds): FC1 1079 TFLOP/s (FC2 1087; the first "
                               "FC2 kernel 1020) where the bf16 expert-path GEMMs ran 711 / 702, "
                               "so 1.49 x the bf16 rate above; / 132 SMs. The dense ceilings "
                               "(torch._scaled_mm fp8 8192^3 1274, anchors.md FP8 anchors: cuBLAS "
                               "blockwise 1335) are not reached by the promoting mainloop",
        "hbm_bytes_per_s": "anchors: device copy (read + write) 4.22 TB/s measured on one H200 "
                           "(datasheet HBM 4.8 TB/s)",
        "link_bytes_per_s": "anchors: copy-engine peer copy 395 GB/s each direction measured on "
                            "2x H200 (datasheet NVLink4 450 GB/s)",
        "link_peak_bytes_per_s": "anchors: Physical limits, NVLink 4 450 GB/s each way per GPU",
        "sm_copy_bytes_per_s": "measured: mok_cute.bench.calibrate.fit_megakernel_comm('run16_bulk')"
                               " on benchmarks/results/2026-11-29_h200_megakernel_comm_records.npz"
                               ", run 16 of docs/gpu_runs.md (git history; the real megakernel on one H200 "
                               "at R = 1, 8 comm CTAs, cp.async.bulk copies, dynamic tickets): least "
                               "squares duration = overhead + bytes / rate over the 1330 DISPATCH "
                               "records of dsv3_ep8_rank (1.72 MB per task) and sonic_120b (1.02 "
                               "MB) gives 87.9 GB/s per comm SM plus 31.9 us per 128-row task "
                               "(effective 33 and 23 GB/s per task). A LOCAL HBM-to-HBM copy: "
                               "peer (NVLink) reads may be slower per SM (not measured). Run 13 "
                               "(vector copies, 4 x 16 B in flight per lane) fits 20.5 GB/s with "
                               "no intercept. Was: assumption 40 GB/s",
        "gemm_task_overhead_s": "assumption: 1.5 us per tile (pipeline fill + epilogue store); "
                                "fit by mok_cute.bench.calibrate.fit_gemm",
        "comm_task_overhead_s": "measured: the same fit (run 16 records): intercept 31.9 us per "
                                "128-row task + 1.7 us median gap between a comm CTA's tasks "
                                "(ticket, record write; outside the records' spans). A no-op task "
                                "takes 1.7 us, so the intercept is mostly per-row latency (about "
                                "0.25 us per row): valid for tasks of tile_m = 128 rows, the "
                                "megakernel's only comm task size. Was: assumption 2 us",
        "comm_task_serial_s": "measured: the same records: the 1.7 us median gap between a comm "
                              "CTA's tasks (a no-op task also takes 1.7 us) is serial; the "
                              "31.9 us intercept is per-row latency, spent during the flow as a "
                              "per-SM rate cap (an isolated task keeps the fitted time)",
        "barrier_latency_s": "assumption: 5 us unicast-flag round trip over NVLink",
    },
)

GB300_NVL72 = HardwareProfile(
    name="gb300_nvl72",
    description="GB300 NVL72: 72 Blackwell Ultra GPUs on one NVLink 5 switch domain",
    num_gpus=72,
    num_sms=148,
    sm_tensor_flops=2.5e15 * _ACHIEVED_FRACTION / 148,
    sm_fp8_tensor_flops=2 * 2.5e15 * _ACHIEVED_FRACTION / 148,
    hbm_bytes_per_s=8e12 * _H200_HBM_FRACTION,
    link_bytes_per_s=900e9 * _H200_LINK_FRACTION,
    link_peak_bytes_per_s=900e9,
    sm_copy_bytes_per_s=46e9,
    gemm_task_overhead_s=1.5e-6,
    comm_task_overhead_s=2.0e-6,
    barrier_latency_s=8.0e-6,
    sources={
        "num_gpus": "anchors: GB300 NVL72, 72 GPUs in one NVLink domain",
        "num_sms": "148 as CUDA reports on a B300 SKU (public B300 benchmark write-up found by "
                   "code search: 'CUDA reports 148 SMs on this B300 SKU'); the full Blackwell "
                   "Ultra die has 160 (NVIDIA, Hot Chips 2025); the GB300 count is unverified",
        "sm_tensor_flops": "anchors: GB300 dense BF16 2.5 PFLOP/s (datasheet) x 0.731, the "
                           "measured/datasheet ratio of the H200 (723/989), / 148 SMs",
        "sm_fp8_tensor_flops": "datasheet-derived: anchors: GB300 dense BF16 / FP8 2.5 / 5 "
                               "PFLOP/s (datasheet), so 2 x sm_tensor_flops above; "
                               "unmeasured (on the H200 our block-scaled FP8 GEMMs reach 1.49 x "
                               "bf16, its promotion in software; Blackwell scales in hardware)",
        "hbm_bytes_per_s": "datasheet: GB300 HBM3e 8 TB/s x 0.879, the H200 measured/datasheet "
                           "copy ratio (4.22/4.8)",
        "link_bytes_per_s": "anchors: NVLink 5 900 GB/s each way per GPU x 0.878, the H200 "
                            "measured/datasheet peer-copy ratio (395/450)",
        "link_peak_bytes_per_s": "anchors: Physical limits, NVLink 5 900 GB/s each way",
        "sm_copy_bytes_per_s": "anchors: HybridEP BF16 dispatch 735 GB/s with 16 SMs on B200 "
                               "= 46 GB/s per SM (a lower bound: that run may be link-bound)",
        "gemm_task_overhead_s": "assumption: as h200_hgx",
        "comm_task_overhead_s": "assumption: 2 us per comm task (the H200's measured 33.6 us is "
                                "per-row latency of one copy method at 128 rows per task; it is "
                                "not carried over to the effective 46 GB/s above)",
        "barrier_latency_s": "assumption: 8 us unicast-flag round trip across NVL72 trays",
    },
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (H200_HGX, GB300_NVL72)}


def get_profile(profile: str | HardwareProfile) -> HardwareProfile:
    if isinstance(profile, HardwareProfile):
        return profile
    if not isinstance(profile, str):
        raise TypeError(f"profile must be a name or a HardwareProfile, got "
                        f"{type(profile).__name__}")
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    return PROFILES[profile]


def profile_for_device(device_name: str) -> HardwareProfile:
    """The profile for a ``torch.cuda.get_device_name()`` string (for resolving a MoKConfig on
    the GPU it runs on): H100/H200 -> h200_hgx, B300/GB300 -> gb300_nvl72."""
    n = device_name.upper()
    if "H200" in n or "H100" in n or "H800" in n:
        return H200_HGX
    if "B300" in n or "GB300" in n:
        return GB300_NVL72
    raise ValueError(f"device_name: no simulator profile for {device_name!r}; expected an "
                     f"H100/H200 or B300/GB300 (profiles: {sorted(PROFILES)})")
