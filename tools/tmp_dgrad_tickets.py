"""TEMPORARY (thirty-ninth session): the backward megakernel's dgrads by dynamic tickets
(megakernel_backward.TEMPORARY_DGRAD_TICKETS) against the static stride: the GPU tests under
the flag, then whole moe_backward (launches / megakernel static / megakernel dynamic),
interleaved rounds, bits checked."""
import json, sys, subprocess, time
import torch
sys.path.insert(0, __file__.rsplit('/tools/', 1)[0])
sys.path.insert(0, __file__.rsplit('/tools/', 1)[0] + "/tests")
from tools.layer_profile import gpu_ms
from mok_cute import megakernel_backward as mb

def mhz():
    return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True).stdout.strip()

def probe(name, rounds, reps):
    import mok_cute
    from mok_cute import expert_backward as eb, expert_path
    from mok_cute.bench.problems import make_problem
    from mok_cute.shapes import resolve_shape
    p = make_problem(resolve_shape(name), device="cuda", seed=1)
    i = p.inputs
    cfg = mok_cute.MoKConfig(backend="kernel", check_ids=False)
    with torch.no_grad():
        _, s = expert_path.moe_forward_kernel(i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down, None, cfg, save=True)
    d_out = torch.randn_like(i.x)
    def run(dgrads, tickets):
        def f():
            mb.TEMPORARY_DGRAD_TICKETS = tickets
            return eb.moe_backward(d_out, i.x, i.topk_idx, i.topk_weights, p.w_gate, p.w_up, p.w_down, None, s, dgrads=dgrads)
        return f
    fns = {"launches": run("kernels", False), "mk_static": run("megakernel", False), "mk_tickets": run("megakernel", True)}
    outs = {k: f() for k, f in fns.items()}
    same = {k: all(torch.equal(a, b) for a, b in zip(outs[k], outs["mk_static"]) if a is not None) for k in ("launches", "mk_tickets")}
    again = fns["mk_tickets"]()
    same["mk_tickets_repeat"] = all(torch.equal(a, b) for a, b in zip(again, outs["mk_tickets"]) if a is not None)
    del outs, again
    res = {k: [] for k in fns}
    order = list(fns)
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            res[k].append(gpu_ms(fns[k], reps))
    mb.TEMPORARY_DGRAD_TICKETS = False
    med = lambda v: sorted(v)[len(v) // 2]
    r_ts = med([a / b for a, b in zip(res["mk_tickets"], res["mk_static"])])
    r_sl = med([a / b for a, b in zip(res["mk_static"], res["launches"])])
    r_tl = med([a / b for a, b in zip(res["mk_tickets"], res["launches"])])
    print(f"{name:18s} launches {med(res['launches']):.3f} mk static {med(res['mk_static']):.3f} mk tickets {med(res['mk_tickets']):.3f} | "
          f"tickets/static {r_ts:.3f} static/launches {r_sl:.3f} tickets/launches {r_tl:.3f} | bits {same} | {mhz()} MHz", flush=True)
    return dict(shape=name, ms=res, tickets_over_static=r_ts, static_over_launches=r_sl,
                tickets_over_launches=r_tl, bitwise=same)

if __name__ == "__main__":
    out = sys.argv[2]
    t0 = time.time()
    if sys.argv[3] == "tests":
        import pytest
        mb.TEMPORARY_DGRAD_TICKETS = True
        rc = pytest.main(["-q", "-x", "-m", "gpu", "-o", "timeout=100", "-p", "no:cacheprovider",
                          "tests/test_megakernel_backward.py", "-k",
                          "dgrads_equal_the_two or weight_gradients_equal_gemm or shared_expert_in_the_launch"])
        mb.TEMPORARY_DGRAD_TICKETS = False
        print("pytest rc", rc, f"{time.time() - t0:.0f} s", flush=True)
        if rc != 0:
            sys.exit(1)
    rows = []
    for sname in sys.argv[1].split(";"):
        rows.append(probe(sname, 4, 5)); torch.cuda.empty_cache()
        json.dump(dict(command="python tools/tmp_dgrad_tickets.py '" + sys.argv[1] + "' OUT " + sys.argv[3], rows=rows),
                  open(out, "w"), separators=(",", ":"))
