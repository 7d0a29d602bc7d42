"""Timeline decoder and exporters on synthetic buffers (CPU), plus a recorded run on the GPU."""

import importlib.util
import json

import numpy as np
import pytest
import torch

from mok_cute import timeline as tlm
from mok_cute.bench import record_timeline
from mok_cute.tasks import Role, TaskType
from mok_cute.timeline import HEADER_WORDS, RECORD_WORDS
from per_token import assert_tokens_close

C, P = Role.COMM, Role.COMPUTE
T0 = 1_700_000_000_000  # a plausible %globaltimer value (ns)


def rec(role, task_type, task_id, start, end, rank=0, sm=0, cta=None):
    return (int(role), int(task_type), task_id, rank, sm, sm if cta is None else cta, start, end)


def two_sm_timeline():
    """SM 0 (comm) and SM 1 (compute) with known busy / wait / idle.

    SM 0: DISPATCH [0,100)  WAIT [100,150)  COMBINE [150,250)           -> busy 200, wait 50
    SM 1: WAIT [0,100)  FC1 [100,300)  FC2 [300,360)  KSUM [370,400)    -> busy 290, wait 100
    layer span [0, 400)
    """
    rows = [
        rec(C, TaskType.DISPATCH, 0, 0, 100, sm=0),
        rec(P, TaskType.WAIT, 0, 0, 100, sm=1),
        rec(C, TaskType.WAIT, 2, 100, 150, sm=0),
        rec(P, TaskType.FC1, 1, 100, 300, sm=1),
        rec(C, TaskType.COMBINE, 3, 150, 250, sm=0),
        rec(P, TaskType.FC2, 2, 300, 360, sm=1),
        rec(P, TaskType.KSUM, 4, 370, 400, sm=1),
    ]
    return tlm.decode(tlm.encode_records(rows, t0_ns=T0))


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------


def test_enum_values_match_the_record_format():
    assert [(r.name, int(r)) for r in Role] == [("COMM", 0), ("COMPUTE", 1)]
    assert [(t.name, int(t)) for t in TaskType] == [
        ("DISPATCH", 0), ("FC1", 1), ("FC2", 2), ("COMBINE", 3), ("SHARED_FC1", 4),
        ("SHARED_FC2", 5), ("KSUM", 6), ("BARRIER", 7), ("WAIT", 8), ("STAGE_WAIT", 9),
        ("EPILOGUE", 10), ("SIGNAL", 11),
    ]


def test_decode_reads_every_packed_field_of_a_hand_written_buffer():
    buf = np.zeros(HEADER_WORDS + 2 * RECORD_WORDS, dtype=np.int64)
    buf[:3] = (2, 2, T0)
    # Record 0 packed by hand: role 1, type FC2, rank 70, sm 131, cta 40000 (bit 63 set -> negative int64).
    word0 = 1 | (2 << 8) | (70 << 16) | (131 << 32) | (40000 << 48)
    buf[8:12] = (np.uint64(word0).view(np.int64), 12345, T0 + 500, T0 + 1500)
    buf[12:16] = (0 | (9 << 8), 7, T0 - 20, T0 + 30)  # starts before the kernel-start stamp
    tl = tlm.decode(buf)
    assert (tl.capacity, tl.written, tl.dropped, tl.t0_ns, len(tl)) == (2, 2, 0, T0, 2)
    r0, r1 = tl.records[0], tl.records[1]
    assert (r0["role"], r0["task_type"], r0["rank"], r0["sm_id"], r0["cta_id"]) == (1, 2, 70, 131, 40000)
    assert (r0["task_id"], r0["start_ns"], r0["end_ns"]) == (12345, 500, 1500)
    assert (r1["role"], r1["task_type"], r1["task_id"], r1["start_ns"], r1["end_ns"]) == (0, 9, 7, -20, 30)
    assert tl.span_ns == (-20, 1500)


def test_encode_is_the_inverse_of_decode_and_accepts_torch_tensors():
    buf = tlm.synthetic_buffer(num_ranks=2, seed=3)
    tl = tlm.decode(torch.from_numpy(buf))
    assert np.array_equal(tlm.encode_records(tl.records, t0_ns=tl.t0_ns), buf)
    assert len(tl) == (buf.size - HEADER_WORDS) // RECORD_WORDS


def test_overflow_counts_dropped_records_and_reads_nothing_past_capacity():
    rows = [rec(P, TaskType.FC1, i, 10 * i, 10 * i + 5, sm=i % 3) for i in range(7)]
    buf = tlm.encode_records(rows, capacity=4)
    assert buf.size == HEADER_WORDS + 4 * RECORD_WORDS  # no room for the extra three
    assert (buf[0], buf[1]) == (4, 7)
    tl = tlm.decode(buf)
    assert (len(tl), tl.written, tl.dropped) == (4, 7, 3)
    assert tl.records["task_id"].tolist() == [0, 1, 2, 3]
    # Decoding a view that ends exactly at the last slot proves no word beyond it is touched.
    tail_guard = np.concatenate([buf, np.full(RECORD_WORDS, -1, dtype=np.int64)])
    assert len(tlm.decode(tail_guard[: buf.size])) == 4
    assert "3 records dropped" in tl.check()[0]
    # mok-cute timeline records once more with room for all 7 (a power of two), not when none dropped
    assert record_timeline.capacity_for(tl) == 8
    assert record_timeline.capacity_for(tlm.decode(tlm.encode_records(rows[:4], capacity=4))) == 0


def test_ticket_below_capacity_reads_only_written_slots():
    rows = [rec(P, TaskType.FC1, i, i, i + 1) for i in range(5)]
    buf = tlm.encode_records(rows, capacity=16)
    buf[HEADER_WORDS + 5 * RECORD_WORDS :] = -7  # stale garbage past the ticket
    tl = tlm.decode(buf)
    assert (len(tl), tl.dropped) == (5, 0)


@pytest.mark.parametrize(
    "buf, exc, words",
    [
        (np.zeros(4, dtype=np.int64), ValueError, "header"),
        (np.zeros((2, 8), dtype=np.int64), ValueError, "1-D"),
        (np.zeros(16, dtype=np.float32), TypeError, "int64"),
        ([0] * 16, TypeError, "list"),
        (np.array([5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=np.int64), ValueError, "capacity=5"),
        (np.array([1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=np.int64), ValueError, "record count"),
    ],
)
def test_decode_rejects_malformed_buffers_naming_buf(buf, exc, words):
    with pytest.raises(exc, match="buf") as info:
        tlm.decode(buf)
    assert words in str(info.value)


def test_timeline_buffer_header_reset_save_and_decode(tmp_path):
    tb = tlm.TimelineBuffer(capacity=8, device="cpu")
    assert tb.tensor.dtype == torch.int64 and tb.tensor.numel() == HEADER_WORDS + 8 * RECORD_WORDS
    assert tb.tensor[0].item() == 8 and tb.tensor[1:].abs().sum().item() == 0
    assert len(tb.decode()) == 0
    filled = torch.from_numpy(tlm.encode_records([rec(P, TaskType.FC1, 5, 0, 9)] * 3, capacity=8))
    tb.tensor.copy_(filled)
    assert len(tb.decode()) == 3
    saved = tb.save(tmp_path / "buf.npy")
    assert len(tlm.decode(np.load(saved))) == 3
    tb.reset()
    assert tb.tensor[0].item() == 8 and tb.tensor[1:HEADER_WORDS].abs().sum().item() == 0
    assert len(tb.decode()) == 0
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="capacity"):
            tlm.TimelineBuffer(capacity=bad, device="cpu")


def test_set_last_and_last():
    tb = tlm.TimelineBuffer(capacity=2, device="cpu")
    tlm.set_last(tb)
    assert tlm.last() is tb
    tlm.set_last(None)
    assert tlm.last() is None
    with pytest.raises(TypeError, match="tb"):
        tlm.set_last(np.zeros(8))


def test_encode_rejects_fields_that_do_not_fit_their_bits():
    with pytest.raises(ValueError, match="sm_id"):
        tlm.encode_records([rec(P, TaskType.FC1, 0, 0, 1, sm=1 << 16)])


# --------------------------------------------------------------------------------------------
# summary
# --------------------------------------------------------------------------------------------


def test_summary_numbers_are_exact_on_a_hand_built_timeline():
    tl = two_sm_timeline()
    s = tlm.summarize(tl, flops=4e5, dispatch_bytes=1000, combine_bytes=500)
    assert s["span_ns"] == 400 and s["records"] == 7 and s["dropped"] == 0
    comm, compute = s["roles"]["comm"], s["roles"]["compute"]
    assert (comm["lanes"], comm["busy_ns"], comm["wait_ns"], comm["idle_ns"]) == (1, 200, 50, 150)
    assert (comm["busy_pct"], comm["wait_pct"], comm["idle_pct"]) == (50.0, 12.5, 37.5)
    assert (compute["lanes"], compute["busy_ns"], compute["wait_ns"], compute["idle_ns"]) == (1, 290, 100, 10)
    assert (compute["busy_pct"], compute["wait_pct"], compute["idle_pct"]) == (72.5, 25.0, 2.5)
    assert s["dispatch_gbps"] == 1000 / 100  # bytes / ns over the DISPATCH span
    assert s["combine_gbps"] == 500 / 100
    assert s["gemm_tflops"] == 4e5 / 260 / 1e3  # FC1 [100,300) and FC2 [300,360)
    assert s["layer_tflops"] == 4e5 / 400 / 1e3
    # comm tasks [0,100) + [150,250); compute runs over [100,360) + [370,400): [0,100) is exposed.
    assert (s["exposed_comm_ns"], s["exposed_comm_pct"]) == (100, 25.0)
    assert s["task_counts"] == {"DISPATCH": 1, "FC1": 1, "FC2": 1, "COMBINE": 1, "KSUM": 1, "WAIT": 2}


def test_summary_waits_nested_in_a_task_and_overlapping_spans_count_once():
    rows = [
        rec(P, TaskType.FC1, 0, 0, 100, sm=4),
        rec(P, TaskType.WAIT, 9, 20, 50, sm=4),  # spun inside FC1
        rec(P, TaskType.FC2, 1, 200, 300, sm=5),
        rec(P, TaskType.FC2, 2, 250, 300, sm=5, cta=5),  # same CTA, overlapping: counted once
    ]
    s = tlm.summarize(tlm.decode(tlm.encode_records(rows)))
    compute = s["roles"]["compute"]
    assert compute["lanes"] == 2
    assert compute["busy_ns"] == 70 + 100 and compute["wait_ns"] == 30
    assert compute["idle_ns"] == 2 * 300 - 170 - 30
    assert s["exposed_comm_ns"] == 0 and "comm" not in s["roles"]
    assert s["dispatch_gbps"] is None and s["gemm_tflops"] is None and s["layer_tflops"] is None
    # one task's time per type: FC2 ran 100 and 50 ns, FC1 100 (WAITs are tasks too)
    assert s["task_us"]["FC2"] == pytest.approx({"mean": 0.075, "p50": 0.075, "p90": 0.095, "max": 0.1})
    assert s["task_us"]["FC1"]["max"] == pytest.approx(0.1) and s["task_us"]["WAIT"]["mean"] == pytest.approx(0.03)


def _checked_summary(rows):
    """One compute CTA's hand-written records: the decoded timeline (which must pass its
    checks), its summary and the CTA's (busy, wait, idle) ns."""
    tl = tlm.decode(tlm.encode_records(rows))
    assert tl.check() == []
    s = tlm.summarize(tl)
    compute = s["roles"]["compute"]
    return tl, s, (compute["busy_ns"], compute["wait_ns"], compute["idle_ns"])


def test_stage_waits_count_as_waits_inside_their_gemm_task():
    """A STAGE_WAIT (the consumers waiting for a GEMM task's first stage) is time spent
    spinning: it comes off the CTA's busy time as a WAIT does, it is not a task of its own for
    the overlap check or the tile rates, and its durations are reported per type."""
    rows = [rec(P, TaskType.FC1, 0, 0, 100, sm=4), rec(P, TaskType.STAGE_WAIT, 0, 0, 20, sm=4),
            rec(P, TaskType.FC1, 1, 100, 200, sm=4), rec(P, TaskType.STAGE_WAIT, 1, 100, 140, sm=4)]
    tl, s, busy_wait_idle = _checked_summary(rows)
    assert busy_wait_idle == (140, 60, 0)
    assert s["task_us"]["STAGE_WAIT"]["mean"] == pytest.approx(0.03)
    assert s["task_overlap"] == pytest.approx(1.0) and s["task_period_us"] == {"FC1": 0.1}
    assert tlm.is_wait(tl.records).tolist() == [False, True, False, True]


def test_phases_split_their_gemm_task_without_counting_as_tasks(tmp_path):
    """A GEMM task's EPILOGUE and SIGNAL phases lie inside its span: the overlap check, the
    busy time, the task overlap and the tile rates ignore them, and their durations are
    reported per type (where a per-task overhead goes); the swimlane PNG leaves them out."""
    rows = [rec(P, TaskType.FC2, 0, 0, 100, sm=4), rec(P, TaskType.EPILOGUE, 0, 80, 95, sm=4),
            rec(P, TaskType.SIGNAL, 0, 95, 100, sm=4), rec(P, TaskType.FC2, 1, 100, 200, sm=4),
            rec(P, TaskType.EPILOGUE, 1, 170, 190, sm=4), rec(P, TaskType.SIGNAL, 1, 190, 200, sm=4)]
    tl, s, busy_wait_idle = _checked_summary(rows)
    assert busy_wait_idle == (200, 0, 0)
    assert s["task_overlap"] == pytest.approx(1.0) and s["task_period_us"] == {"FC2": 0.1}
    assert s["task_us"]["EPILOGUE"]["mean"] == pytest.approx(0.0175)
    assert s["task_us"]["SIGNAL"]["max"] == pytest.approx(0.01)
    assert s["task_counts"] == {"FC2": 2, "EPILOGUE": 2, "SIGNAL": 2}
    assert tlm.is_phase(tl.records).tolist() == [False, True, True, False, True, True]
    assert not tlm.is_wait(tl.records).any()
    pytest.importorskip("matplotlib")
    assert tlm.plot_swimlanes(tl, tmp_path / "lanes.png").stat().st_size > 0


def test_summary_task_overlap_and_period_of_two_warpgroups_tiles():
    """CTA 4 runs FC1 tiles one at a time (ends 10 ns apart: period 0.01 us, overlap 1);
    CTA 5 runs two warpgroups' FC2 tiles of 20 ns, each starting 10 ns after the other
    (period 0.01 us, spans 60 over a union of 40: overlap 1.5). The mean overlap is 1.25."""
    rows = [rec(P, TaskType.FC1, i, 10 * i, 10 * i + 10, sm=4) for i in range(3)]
    rows += [rec(P, TaskType.FC2, 10 + i, 10 * i, 10 * i + 20, sm=5) for i in range(3)]
    rows += [rec(P, TaskType.WAIT, 99, 0, 40, sm=4)]  # waits are not tasks here
    s = tlm.summarize(tlm.decode(tlm.encode_records(rows)))
    assert s["task_overlap"] == pytest.approx(1.25)
    assert s["task_period_us"] == pytest.approx({"FC1": 0.01, "FC2": 0.01})


def test_summary_gap_after_each_gemm_task_and_its_epilogue_by_type():
    """Per GEMM type: the time from a task's end to its CTA's next task start (a per-tile cost
    no span covers: CTA 4's FC1 tiles leave 5 and 15 ns, the last none) and the mean of its
    EPILOGUE phases, found by the task whose span holds the phase (the backward's weight
    gradients: 4 and 6 ns; a WAIT between tasks is not a task start)."""
    from mok_cute.tasks_backward import BackwardTaskType as BT

    rows = [rec(P, TaskType.FC1, 0, 0, 10, sm=4), rec(P, TaskType.FC1, 1, 15, 25, sm=4),
            rec(P, TaskType.FC1, 2, 40, 50, sm=4), rec(P, TaskType.WAIT, 9, 26, 39, sm=4)]
    rows += [rec(P, BT.WGRAD_GATE_UP, 7, 0, 20, sm=5), rec(P, TaskType.EPILOGUE, 7, 16, 20, sm=5),
             rec(P, BT.WGRAD_GATE_UP, 8, 22, 40, sm=5), rec(P, TaskType.EPILOGUE, 8, 34, 40, sm=5)]
    s = tlm.summarize(tlm.decode(tlm.encode_records(rows)))
    assert s["task_gap_us"]["FC1"] == pytest.approx({"mean": 0.01, "p50": 0.01, "p90": 0.014})
    assert s["task_gap_us"]["WGRAD_GATE_UP"] == pytest.approx({"mean": 0.002, "p50": 0.002,
                                                               "p90": 0.002})
    assert s["task_epilogue_us"] == pytest.approx({"WGRAD_GATE_UP": 0.005})


def test_summary_of_an_empty_recording():
    s = tlm.summarize(tlm.decode(tlm.TimelineBuffer(4, device="cpu").tensor), flops=1.0)
    assert s["span_ns"] == 0 and s["roles"] == {} and s["exposed_comm_pct"] == 0.0 and s["gemm_tflops"] is None
    assert s["task_overlap"] is None and s["task_period_us"] == {}
    assert s["task_gap_us"] == {} and s["task_epilogue_us"] == {}


def test_print_summary_prints_the_numbers():
    from rich.console import Console

    console = Console(record=True, width=120)
    s = tlm.print_summary(two_sm_timeline(), console=console, flops=4e5, dispatch_bytes=1000)
    text = console.export_text()
    assert s["exposed_comm_pct"] == 25.0
    for expected in ("comm", "compute", "72.5", "37.5", "10.0 GB/s", "25.0 %", "one task's time"):
        assert expected in text


# --------------------------------------------------------------------------------------------
# Chrome trace
# --------------------------------------------------------------------------------------------

# The trace-event format (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
# an object with traceEvents; every event has name/ph/ts/pid/tid; complete events ('X') carry a
# non-negative dur; metadata events ('M') name processes and threads through args.name.
TRACE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "ph", "ts", "pid", "tid"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "ph": {"enum": ["X", "M"]},
                    "ts": {"type": "number", "minimum": 0},
                    "pid": {"type": "integer", "minimum": 0},
                    "tid": {"type": "integer", "minimum": 0},
                    "cat": {"type": "string"},
                    "args": {"type": "object"},
                },
                "allOf": [
                    {
                        "if": {"properties": {"ph": {"const": "X"}}},
                        "then": {
                            "required": ["dur"],
                            "properties": {"dur": {"type": "number", "minimum": 0}},
                        },
                    },
                    {
                        "if": {"properties": {"ph": {"const": "M"}}},
                        "then": {
                            "required": ["args"],
                            "properties": {
                                "name": {"enum": ["process_name", "thread_name", "process_sort_index", "thread_sort_index"]},
                            },
                        },
                    },
                ],
            },
        },
    },
}


def validate_trace(trace):
    import jsonschema

    jsonschema.validate(trace, TRACE_EVENT_SCHEMA)


def test_chrome_trace_is_valid_and_maps_ranks_sms_and_times(tmp_path):
    tl = two_sm_timeline()
    path = tlm.write_chrome_trace(tl, tmp_path / "t.json")
    trace = json.loads(path.read_text())
    validate_trace(trace)
    events = trace["traceEvents"]
    meta = {(e["name"], e["pid"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[("process_name", 0, 0)]["name"] == "rank 0"
    assert meta[("thread_name", 0, 0)]["name"] == "SM 0 (comm)"
    assert meta[("thread_name", 0, 1)]["name"] == "SM 1 (compute)"
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 7
    fc1 = next(e for e in slices if e["name"] == "FC1")
    assert (fc1["ts"], fc1["dur"], fc1["pid"], fc1["tid"]) == (0.1, 0.2, 0, 1)  # microseconds
    assert fc1["args"] == {"task_id": 1, "cta": 1, "role": "compute"}
    wait = next(e for e in slices if e["name"] == "WAIT" and e["tid"] == 0)
    assert wait["args"]["waited_for_task"] == 2


def test_chrome_trace_of_several_ranks_and_a_negative_start_is_valid():
    rows = [rec(C, TaskType.DISPATCH, 0, -50, 10, rank=r, sm=0) for r in range(3)]
    rows += [rec(P, TaskType.FC1, 1, 10, 40, rank=r, sm=7) for r in range(3)]
    trace = tlm.to_chrome_trace(tlm.decode(tlm.encode_records(rows)))
    validate_trace(trace)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "rank 2"}
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X") == 0.0


def test_trace_schema_rejects_a_negative_duration():
    import jsonschema

    bad = {"traceEvents": [{"name": "FC1", "ph": "X", "ts": 0, "dur": -1, "pid": 0, "tid": 0}]}
    with pytest.raises(jsonschema.ValidationError):
        validate_trace(bad)


# --------------------------------------------------------------------------------------------
# PNG
# --------------------------------------------------------------------------------------------


def _read_png(path):
    import matplotlib.image

    return matplotlib.image.imread(path)


def test_swimlane_png_is_written_with_the_expected_size_and_content(tmp_path):
    tl = tlm.decode(tlm.synthetic_buffer(num_ranks=2, num_comm_sms=3, num_compute_sms=9))
    path = tlm.plot_swimlanes(tl, tmp_path / "lanes.png")
    img = _read_png(path)
    lanes = len(tl.lanes())
    assert lanes == 24
    height_in = min(40.0, max(3.0, 1.2 + 0.16 * lanes))
    assert img.shape[:2] == (round(height_in * 110), round(13 * 110))
    colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 20  # bars, hatching and text, not a blank canvas
    comm_first = [lane[2] for lane in tl.lanes()]
    assert comm_first == ["comm"] * 6 + ["compute"] * 18


def test_swimlane_png_of_an_empty_recording(tmp_path):
    path = tlm.plot_swimlanes(tlm.decode(tlm.encode_records([])), tmp_path / "empty.png")
    assert _read_png(path).shape[0] > 100


# --------------------------------------------------------------------------------------------
# check()
# --------------------------------------------------------------------------------------------


def test_check_finds_role_violations_overlaps_and_duplicate_or_missing_tasks():
    rows = [
        rec(C, TaskType.FC1, 0, 0, 10, sm=0),  # comm CTA running a GEMM
        rec(P, TaskType.FC2, 1, 0, 10, sm=1),
        rec(P, TaskType.FC2, 1, 5, 20, sm=1),  # duplicates task 1
        rec(P, TaskType.FC2, 3, 8, 12, sm=1),  # a third tile at once: more than two warpgroups
        rec(P, TaskType.FC2, 4, 0, 10, sm=2),  # pingpong: two tiles at once on one CTA is fine
        rec(P, TaskType.FC2, 5, 5, 15, sm=2),
        rec(P, TaskType.FC2, 6, 15, 25, sm=2),
        rec(P, TaskType.FC2, 7, 0, 10, sm=3),
        rec(P, TaskType.KSUM, 0, 9, 12, sm=3),  # a k-sum under a tile is not
    ]
    problems = tlm.decode(tlm.encode_records(rows)).check(expected_task_ids=[(1, 0), (2, 1), (2, 2)])
    text = "\n".join(problems)
    assert "comm CTA 0 ran FC1" in text
    assert "CTA 1: tasks overlap" in text
    assert "CTA 2:" not in text
    assert "CTA 3: tasks overlap" in text
    assert "recorded more than once" in text
    assert "never recorded" in text and "(2, 2)" in text
    assert tlm.decode(tlm.synthetic_buffer()).check() == []


def test_the_backward_megakernels_spans_decode_summarize_check_and_draw(tmp_path):
    """The backward megakernel's task types (``tasks_backward.BackwardTaskType``) share the
    record format: named in the summary, its GEMMs counted as GEMM time (two pingpong tiles
    at once allowed), a compute CTA running a row copy flagged, drawn without "unknown"."""
    from mok_cute.tasks_backward import BackwardTaskType as BT

    assert tlm.task_name(BT.FC2_DGRAD) == "FC2_DGRAD" and tlm.task_name(99) == "TASK99"
    rows = [
        rec(P, BT.FC2_DGRAD, 0, 0, 100, sm=1),
        rec(P, BT.FC2_DGRAD, 1, 40, 140, sm=1),  # the other warpgroup's tile
        rec(P, TaskType.EPILOGUE, 0, 80, 100, sm=1),
        rec(P, TaskType.WAIT, 5, 0, 30, sm=2),
        rec(P, BT.FC1_DGRAD, 5, 30, 130, sm=2),
        rec(P, BT.WGRAD_GATE_UP, 9, 140, 300, sm=2),
        rec(C, BT.REVERSE_COMBINE, 2, 0, 50, sm=0),
        rec(C, BT.KSUM, 3, 300, 320, sm=0),
    ]
    tl = tlm.decode(tlm.encode_records(rows))
    assert tl.check() == []
    summary = tlm.summarize(tl, flops=2e6)
    assert summary["task_counts"]["FC2_DGRAD"] == 2 and summary["task_counts"]["KSUM"] == 1
    assert summary["gemm_tflops"] == 2e6 / 300 / 1e3  # the GEMM spans' union: [0, 300)
    assert summary["exposed_comm_ns"] == 0  # the pull runs under FC2_DGRAD tiles
    wrong = tlm.decode(tlm.encode_records([rec(P, BT.REVERSE_DISPATCH, 4, 0, 10, sm=3)]))
    assert "ran REVERSE_DISPATCH task 4" in "\n".join(wrong.check())
    path = tlm.plot_swimlanes(tl, tmp_path / "backward.png", title="backward")
    assert _read_png(path).shape[0] > 100


def test_main_backward_refuses_ranks_and_config_fields(tmp_path, capsys):
    """``mok-cute timeline --backward`` records the one-rank backward megakernel as it is."""
    assert record_timeline.main(["--backward", "--ranks", "8", "--out", str(tmp_path)]) == 2
    assert "--backward records the one-rank backward megakernel" in capsys.readouterr().out
    assert record_timeline.main(["--backward", "--mok-config", "num_comm_sms=4",
                                 "--out", str(tmp_path)]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_main_backward_without_a_gpu_says_so_and_fails(tmp_path, capsys):
    assert record_timeline.main(["--backward", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "No timeline recorded" in out and "no CUDA GPU" in out
    assert not (tmp_path / "timeline.png").exists()


# --------------------------------------------------------------------------------------------
# command line (mok-cute timeline: mok_cute.bench.record_timeline)
# --------------------------------------------------------------------------------------------


def test_main_synthetic_writes_the_three_views(tmp_path, capsys):
    assert record_timeline.main(["--synthetic", "--out", str(tmp_path)]) == 0
    validate_trace(json.loads((tmp_path / "timeline_trace.json").read_text()))
    assert _read_png(tmp_path / "timeline.png").size > 0
    summary = json.loads((tmp_path / "timeline_summary.json").read_text())
    assert summary["synthetic"] is True and summary["records"] > 0
    assert "SYNTHETIC" in capsys.readouterr().out


def test_main_decodes_a_saved_buffer(tmp_path):
    np.save(tmp_path / "buf.npy", tlm.encode_records([rec(P, TaskType.FC1, 0, 0, 1000, sm=2)]))
    assert record_timeline.main(["--from", str(tmp_path / "buf.npy"), "--out", str(tmp_path / "o"), "--flops", "2e6"]) == 0
    summary = json.loads((tmp_path / "o" / "timeline_summary.json").read_text())
    assert summary["gemm_tflops"] == 2e6 / 1000 / 1e3
    assert record_timeline.main(["--from", str(tmp_path / "missing.npy"), "--out", str(tmp_path / "o")]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_main_without_a_gpu_says_so_and_fails(tmp_path, capsys):
    assert record_timeline.main(["--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "No timeline recorded" in out and "no CUDA GPU" in out
    assert not (tmp_path / "timeline.png").exists()


def test_main_refuses_a_config_field_that_does_not_exist(tmp_path, capsys):
    assert record_timeline.main(["--out", str(tmp_path), "--mok-config", "megakernel.pingpong=True"]) == 2
    assert "not a field of MegakernelOptions" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--ranks", "0"], "--ranks: expected >= 1, got 0"),
    (["--warmup", "-1"], "--warmup: expected >= 0, got -1"),
    (["--capacity", "0"], "--capacity: expected >= 1, got 0"),
    (["--t-scale", "-1"], "--t-scale: expected a positive factor"),
    (["--shape", "nope"], "shape: expected one of"),
    (["--mok-config", "tile_m=abc"], "MoKConfig.tile_m: expected an int, got str"),
    (["--mok-config", "timeout_ms=0"], "MoKConfig.timeout_ms: expected a finite number > 0"),
    (["--synthetic", "--seed", "-1"], "--seed: expected >= 0 with --synthetic, got -1"),
])
def test_main_refuses_bad_values_before_recording(tmp_path, capsys, argv, message):
    """A usage error (rc 2) naming the option, before any GPU work, not a failed run."""
    assert record_timeline.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# GPU: a real recording
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_recorded_timeline_on_the_gpu_is_sane(tmp_path):
    """Runs moe_forward with the recorder on; every GEMM tile is recorded once, comm CTAs run
    only comm tasks, and times are monotone per CTA."""
    import mok_cute

    torch.manual_seed(0)
    T, H, I, E, K = 512, 1024, 512, 8, 2
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(K, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(T, K, device="cuda"), dim=1)
    wg = (torch.randn(E, I, H, device="cuda") * H**-0.5).to(torch.bfloat16)
    wu = (torch.randn(E, I, H, device="cuda") * H**-0.5).to(torch.bfloat16)
    wd = (torch.randn(E, H, I, device="cuda") * I**-0.5).to(torch.bfloat16)
    config = mok_cute.MoKConfig(timeline=True)
    tlm.set_last(None)
    out = mok_cute.moe_forward(x, idx, w, wg, wu, wd, config=config)
    torch.cuda.synchronize()
    tb = tlm.last()
    assert tb is not None, f"no timeline published; path: {mok_cute.forward_path('cuda', config)}"
    tl = tb.decode()
    assert len(tl) > 0 and tl.dropped == 0
    assert tl.check() == []
    assert np.all(tl.records["end_ns"] >= tl.records["start_ns"])
    assert set(tl.records["task_type"].tolist()) & {int(t) for t in tlm.GEMM_TASK_TYPES}
    trace = tlm.to_chrome_trace(tl)
    if importlib.util.find_spec("jsonschema") is not None:  # the GPU host's image lacks it;
        validate_trace(trace)  # the CPU tests validate the exporter against the schema
    tlm.plot_swimlanes(tl, tmp_path / "gpu.png")
    ref = mok_cute.reference.moe_forward(x, idx, w, wg, wu, wd)
    assert_tokens_close(out, ref, what="recorded call")
