"""Discrete-event simulator of the mok_cute megakernel on NVLink domains (CPU only).

It executes the megakernel's own task list (``mok_cute.tasks``) on every rank of an EP group,
with the same dependencies and the same comm / compute SM split, on a hardware profile whose
every rate names its source (``hardware.py``). ``mok-cute tune`` and the EP path's config
resolution (``tune.tuned_config``) run it; its studies and its fits to measurements live with
the bench (``mok_cute.bench.sim_studies``, ``mok_cute.bench.calibrate``).

    from mok_cute import sim
    cfg = sim.SimConfig(num_comm_sms=24, minibatch_tokens=4096, ring_tokens=32768)
    res = sim.simulate("kimi_k2.7", 8, cfg, "h200_hgx")
    print(res.summary()); res.write_png("kimi.png"); res.write_trace("kimi.json")
"""

from .engine import SimRecords, max_min_rates, run_graph
from .hardware import PROFILES, HardwareProfile, get_profile, profile_for_device
from .model import (MOK_SHAPES, Graph, RankLayout, Routing, SimConfig, SimShape, build_graph,
                    expert_owner, receive_layouts, route)
from .run import SimResult, simulate

__all__ = [
    "PROFILES", "HardwareProfile", "get_profile", "profile_for_device", "MOK_SHAPES", "Graph", "RankLayout",
    "Routing", "SimConfig", "SimShape", "build_graph", "expert_owner", "receive_layouts",
    "route", "SimRecords", "max_min_rates", "run_graph", "SimResult", "simulate",
]
