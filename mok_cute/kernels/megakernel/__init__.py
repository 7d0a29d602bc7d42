"""The MoK megakernel for Hopper: one persistent launch per MoE layer call.

    kernel.py      MegakernelSm90: static config, host __call__ (TMA atoms, smem, launch),
                   the kernel's role branches; compile_megakernel
    scheduler.py   the task walk: tickets, waits, signals, cross-rank flags, the ticket ring
    comm_tasks.py  comm CTAs: DISPATCH / COMBINE row copies, the BARRIER
    gemm_tasks.py  compute CTAs: producer warps and consumer warpgroups of the GEMM tasks
    ksum_tasks.py  compute CTAs: the fixed-order weighted k-sum
"""

from mok_cute.kernels.megakernel.kernel import MegakernelSm90, compile_megakernel

__all__ = ["MegakernelSm90", "compile_megakernel"]
