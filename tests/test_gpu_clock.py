"""mok_cute.bench.gpu_clock: the nvidia-smi sampler the benches record the SM clock and power with.

CPU: parsing a sample line, windows and statistics on hand-made samples, and a sampler that
finds no nvidia-smi records nothing instead of failing. The real sampler runs in every
``mok-cute bench`` with rounds on a GPU (its numbers land in the JSON as ``gpu_clock``)."""

import time

import pytest

from mok_cute.bench import gpu_clock


def test_a_sample_line_parses_to_epoch_clock_power_temperature_reasons():
    stamp, mhz, watts, temp, reasons = gpu_clock.parse_sample(
        "2026/11/30 12:34:56.789, 1455, 688.42, 54, 0x0000000000000004")
    assert (mhz, watts, temp, reasons) == (1455.0, 688.42, 54.0, "0x0000000000000004")
    assert stamp == pytest.approx(time.mktime((2026, 11, 30, 12, 34, 56, 0, 0, -1)) + 0.789)
    assert gpu_clock.parse_sample("2026/11/30 12:34:56.789, 1455, 688.42, 54")[4] == "n/a"
    assert gpu_clock.parse_sample("[N/A], 1455, 688, 54") is None
    assert gpu_clock.parse_sample("") is None


def test_stats_use_only_the_samples_inside_a_names_windows():
    s = gpu_clock.ClockSampler.__new__(gpu_clock.ClockSampler)
    s.samples = [(10.0, 1400.0, 600.0, 50.0, "0x4"), (11.0, 1500.0, 700.0, 55.0, "0x4"),
                 (12.0, 1600.0, 650.0, 52.0, "0x0"), (20.0, 1980.0, 100.0, 40.0, "0x0")]
    s.windows = {"a": [(9.5, 11.5)], "b": [(11.9, 12.1), (19.0, 21.0)], "c": [(30.0, 31.0)]}
    a = s.stats("a")
    assert a == {"samples": 2, "nvidia_smi_id": None, "sm_mhz_median": 1450.0, "sm_mhz_min": 1400.0,
                 "power_w_mean": 650.0, "temp_c_max": 55.0, "clock_event_reasons": ["0x4"]}
    assert s.stats("b")["samples"] == 2 and s.stats("b")["sm_mhz_min"] == 1600.0
    assert s.stats("c") is None and s.stats("never ran") is None


def test_without_nvidia_smi_the_sampler_records_nothing(monkeypatch):
    monkeypatch.setattr(gpu_clock.shutil, "which", lambda name: None)
    with gpu_clock.ClockSampler() as sampler:
        with sampler.window("x"):
            pass
    assert sampler.command is None and sampler.samples == [] and sampler.stats("x") is None


def test_the_sampled_gpu_is_named_and_a_fallback_to_gpu_0_says_so(monkeypatch):
    """nvidia-smi is asked for the device's UUID first; where only GPU 0 answers (the UUID and
    the index did not), the sampler still samples but its stats name that fallback."""
    monkeypatch.setattr(gpu_clock, "device_ids_of", lambda device: ["GPU-abc", "3"])
    monkeypatch.setattr(gpu_clock, "_query", lambda device_id: ["nvidia-smi", str(device_id)])
    assert gpu_clock.ClockSampler(device=3).nvidia_smi_id == "GPU-abc"
    monkeypatch.setattr(gpu_clock, "_query",
                        lambda device_id: None if device_id else ["nvidia-smi", "--id=0"])
    sampler = gpu_clock.ClockSampler(device=3)
    assert sampler.nvidia_smi_id.startswith("0 (") and sampler.command is not None
    assert gpu_clock.ClockSampler().nvidia_smi_id == "0"
