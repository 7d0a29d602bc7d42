"""One way for tests to run a function on every rank of a CPU gloo group (loopback).

`spawn(fn, world, tmp_dir, *args)` starts `world` processes; each joins a gloo group through a
file in `tmp_dir`, runs `fn(rank, world, *args)`, waits for every rank at a barrier, tears the
group down, and leaves with `os._exit(0)`.

Why `os._exit`: gloo's worker threads can still be alive during interpreter finalisation, and
tearing them down there aborts the process ("terminate called without an active exception",
SIGABRT) after every check has passed. CI hit that once (test_ep_uneven_tokens_and_idle_ranks,
2026-11-29); a worker whose checks all passed now skips finalisation. A failing check still
raises before that point, and torch.multiprocessing.spawn turns it into a test failure.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120  # a hang becomes an error, not a stuck test


def _rank_main(rank: int, world: int, init_file: str, fn, args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        fn(rank, world, *args)
        # Tear down only when every rank is done: gloo aborts a process whose peer's group goes
        # away while its last sends are still in flight.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world: int, tmp_dir, *args) -> None:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; raise if any rank fails."""
    init_file = os.path.join(str(tmp_dir), f"gloo_init_{fn.__name__}_{world}")
    mp.spawn(_rank_main, args=(world, init_file, fn, args), nprocs=world, join=True)
