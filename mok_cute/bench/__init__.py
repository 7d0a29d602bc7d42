"""Measuring mok_cute: the benchmark harness and what it needs, outside the runtime library.

    harness.py          ``mok-cute bench``: the one-GPU protocol of DESIGN §5 (contenders, timing,
                        checks against the reference, JSON and chart)
    ep.py               ``mok-cute bench --ep``: the expert-parallel bench across torchrun ranks
    problems.py         random problems of the named shapes (``mok_cute.shapes``)
    torch_moe.py        the PyTorch pipelines the bench times mok_cute against
    common.py           what the benches and the probes in tools/ share (argument parsing,
                        device sync, errors)
    results.py          result files: JSON (with the MoKConfig timed), versions, bar chart
    gpu_clock.py        SM clock and power sampled with nvidia-smi while contenders run
    record_timeline.py  ``mok-cute timeline``: one recorded layer call, exported
    sim_studies.py      the simulator's studies (``tools/sim_studies.py``)
    calibrate.py        the simulator's fits to measured rows and recordings

The library (``mok_cute.api`` and everything it runs) never imports this subpackage
(``tests/test_import_graph.py``). Its charts need matplotlib: ``pip install 'mok-cute[bench]'``.
Importing the subpackage imports none of its modules.
"""
