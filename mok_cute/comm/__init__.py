"""Peer-memory backends (DESIGN §3.2): every backend yields a `PeerTable`, whose Int64 ``bases``
the megakernel reads to reach each rank's symmetric buffer, laid out by `SymmetricLayout`.

- `VirtualPeers`: R ranks in one process on one device, slices of one allocation (R <= 72).
- `IpcPeers`: one process per GPU; cuda-python VMM with POSIX-FD or FABRIC handles, or legacy
  CUDA IPC; handles exchanged over ``torch.distributed``.

`agreement`: the ranks of a group agree on each ``moe_forward(group=...)`` call before they
launch (shapes, dtypes, config, id ranges; host shared memory, no GPU sync); a peer that does
not arrive raises `AgreementTimeout`.

Importing this package does not import cuda-python (the `ipc` backend loads it when used), so
it works on machines without CUDA.
"""

from .agreement import AgreementTimeout
from .ipc import HANDLE_TYPES, IpcPeers, check_cuda, exchange_fds, fabric_support
from .peers import BARRIER_FIELD, BarrierSpec, Field, PeerTable, SymmetricLayout, moe_symmetric_layout
from .virtual import MAX_VIRTUAL_RANKS, VirtualPeers

__all__ = [
    "AgreementTimeout",
    "BARRIER_FIELD",
    "BarrierSpec",
    "Field",
    "HANDLE_TYPES",
    "IpcPeers",
    "MAX_VIRTUAL_RANKS",
    "PeerTable",
    "SymmetricLayout",
    "VirtualPeers",
    "check_cuda",
    "exchange_fds",
    "fabric_support",
    "moe_symmetric_layout",
]
