"""mok_cute: an expert-parallel Mixture-of-Experts layer as CuTe DSL GPU kernels.

Public API (DESIGN §2): `MoKConfig` (with its `ExpertPathOptions`, `MegakernelOptions`), `moe_forward`, `moe_forward_virtual`, `MoELayer`,
`forward_path`, `check_errors` / `PeerTimeoutError` / `SavedRowsError` (megakernel failures), `SavedRowsPool` (saved rows over a group), `forget_quantized_weights` (FP8's weight cache), and the modules `reference` (PyTorch oracle) and `schedule` (receive schedule).
Importing the package does not import the CuTe DSL; the kernel path loads it on first use.
"""

from . import reference, schedule
from .api import MoELayer, forget_quantized_weights, forward_path, moe_forward, moe_forward_virtual
from . import autograd as _autograd  # noqa: F401  registers torch.ops.mok_cute.* (an exported graph's ops)
from .config import ExpertPathOptions, MegakernelOptions, MoKConfig
from .errors import PeerTimeoutError, SavedRowsError, check_errors
from .saved_rows import SavedRowsPool

__version__ = "0.1.0"

__all__ = [
    "ExpertPathOptions",
    "MegakernelOptions",
    "MoKConfig",
    "MoELayer",
    "PeerTimeoutError",
    "SavedRowsError",
    "SavedRowsPool",
    "check_errors",
    "forget_quantized_weights",
    "forward_path",
    "moe_forward",
    "moe_forward_virtual",
    "reference",
    "schedule",
    "__version__",
]
