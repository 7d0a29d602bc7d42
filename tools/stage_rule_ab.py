"""The few-rows operand-stage rule as a whole, in one process: the one-GPU layer (inference
forward; training forward + backward) with ``constants.few_rows_stage_cap`` on (FEW_ROWS_MAX =
256, the product) and off (0: as many stages as fit everywhere), interleaved rounds, out and
every gradient compared bitwise.

    python tools/stage_rule_ab.py 'gptoss_120b;custom:4096,2048,768,128,8' OUT.json [ROUNDS]

Shapes are separated by ';' (a custom shape has commas). A probe for the rule, not the bench of
record.
"""
import json
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])  # run from a checkout
sys.path.insert(0, __file__.rsplit('/', 1)[0])
import mok_cute as mok  # noqa: E402
from mok_cute import constants  # noqa: E402
from layer_profile import layer_call, gpu_ms  # noqa: E402


def ab(name: str, rounds: int) -> dict:
    """One shape's rounds, the rule on and off alternating which goes first."""
    product_max = constants.FEW_ROWS_MAX
    p, forward = layer_call(name)
    i = p.inputs
    leaves = [i.x, i.topk_weights, p.w_gate, p.w_up, p.w_down]
    cfg = mok.MoKConfig(backend="kernel", check_ids=False)
    d_out = torch.randn(i.x.shape, device="cuda", dtype=torch.bfloat16)

    def infer():
        with torch.no_grad():
            return forward(cfg)

    def train():
        for t in leaves:
            t.requires_grad_(True)
            t.grad = None
        y = forward(cfg)
        y.backward(d_out)
        return y

    times = {v: {"infer": [], "train": []} for v in ("on", "off")}
    bits = {}
    try:
        for rnd in range(rounds):
            for variant in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
                constants.FEW_ROWS_MAX = product_max if variant == "on" else 0
                times[variant]["infer"].append(gpu_ms(infer, 10))
                times[variant]["train"].append(gpu_ms(train, 5))
                if rnd == 0:
                    bits[variant] = [train().detach().clone()] + [t.grad.clone() for t in leaves]
    finally:
        constants.FEW_ROWS_MAX = product_max
    row = {"bitwise": all(torch.equal(a, b) for a, b in zip(bits["on"], bits["off"]))}
    for k in ("infer", "train"):
        on, off = times["on"][k], times["off"][k]
        row[k] = {"on_ms": statistics.median(on), "off_ms": statistics.median(off),
                  "on_over_off_paired": statistics.median([a / b for a, b in zip(on, off)]),
                  "rounds_on": on, "rounds_off": off}
    print(name, "bitwise", row["bitwise"],
          {k: (round(row[k]["on_ms"], 3), round(row[k]["off_ms"], 3),
               round(row[k]["on_over_off_paired"], 3)) for k in ("infer", "train")}, flush=True)
    return row


def main(argv) -> None:
    rounds = int(argv[3]) if len(argv) > 3 else 4
    out = {}
    for name in argv[1].split(";"):
        out[name] = ab(name, rounds)
        torch.cuda.empty_cache()
    with open(argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv)
