"""tools/megakernel_probe.py's variant specs (no GPU): every letter sets the module setting it
names, and every setting a spec may set still exists (a removed switch fails here, not on
the GPU host)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe():
    sys.path.insert(0, str(ROOT / "tools"))  # the probe imports its sibling layer_profile
    try:
        import megakernel_probe
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return megakernel_probe


def test_every_switch_a_spec_sets_exists(probe):
    from mok_cute import megakernel, ops

    assert [n for n in probe.SPEC_SWITCHES if not hasattr(megakernel, n)] == []
    assert [n for n in probe.OPS_SWITCHES if not hasattr(ops, n)] == []
    # each setting is read from one of the two spec grammars (--comm, --virtual-comm)
    keys = set(probe.parse_spec("0")) | set(probe.parse_virtual_spec("0"))
    assert set(probe.SPEC_SWITCHES.values()) <= keys


@pytest.mark.parametrize("spec,expected", [
    ("0lxwfkuesmhj", dict(comm=0, local_direct=True, defer_signals=False, defer_flush_ktiles=1,
                          wide_epilogue=False, ksum_rows=8, fc1_lead=True,
                          strided_tickets=False)),
    ("0lxwfkuesmhjvr", dict(defer_signals=True, defer_flush_ktiles=8)),
    ("0lxwfkuesmhjvrt", dict(defer_signals=True, defer_flush_ktiles=8, strided_tickets=True)),
    ("0lxwfkuesmhjvy", dict(defer_signals=True, defer_flush_ktiles=4)),
    ("0lxwfkuesmhjg", dict(wide_epilogue=True, defer_signals=False)),
    ("2lf3", dict(comm=2, fc1_lead=True, fc1_lead_minibatches=3)),
])
def test_spec_letters(probe, spec, expected):
    sp = probe.parse_spec(spec)
    assert {k: sp[k] for k in expected} == expected


def test_an_unknown_letter_is_refused(probe):
    with pytest.raises(SystemExit, match="cannot read"):
        probe.parse_spec("0lp")
