"""TEMPORARY A/B: the FP8 megakernel at one rank with FC2's publish held (``FP8_DEFER_AB``)
against publishing at once, and the FP8 expert path, as layers in interleaved rounds; bits
checked against the expert path."""
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])
from mok_cute import megakernel  # noqa: E402
from mok_cute.config import MoKConfig  # noqa: E402
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from layer_profile import gpu_ms, layer_call  # noqa: E402

shapes = sys.argv[1].split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
expert = MoKConfig(check_ids=False, precision="fp8")
mk = MoKConfig(check_ids=False, precision="fp8", backend="megakernel")
for name in shapes:
    p, fwd = layer_call(name)

    def mk_with(defer):
        def run():
            megakernel.FP8_DEFER_AB = defer
            try:
                return fwd(mk)
            finally:
                megakernel.FP8_DEFER_AB = True
        return run
    variants = {"expert": lambda: fwd(expert), "mk_defer": mk_with(True), "mk_now": mk_with(False)}
    base = variants["expert"]()
    for k, f in variants.items():
        print(name, k, "bitwise the expert path:", torch.equal(f(), base), flush=True)
    ms = {k: [] for k in variants}
    for r in range(rounds):
        for k, f in (variants.items() if r % 2 == 0 else reversed(variants.items())):
            ms[k].append(gpu_ms(f, 20))
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(name, " ".join(f"{k} {med[k]:.3f}" for k in med),
          f"| mk_defer/expert {med['mk_defer'] / med['expert']:.3f} mk_now/expert "
          f"{med['mk_now'] / med['expert']:.3f} defer speed x now {med['mk_now'] / med['mk_defer']:.3f}",
          flush=True)
