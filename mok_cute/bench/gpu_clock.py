"""SM clock and power draw while kernels run, from ``nvidia-smi`` sampled in the background.

Why the benches record them: the H200 runs every MoE layer of the benches at its 700 W power
cap (clock-event reason 0x4, SW power cap), at an SM clock of 1350-1620 MHz of its 1980
(fifteenth session, ``tools/clock_probe.py``). At the cap a kernel's speed is its work per
joule, so two contenders can differ by their clocks as much as by their cycles, and a
contender timed right after a pause starts cooler and faster. ``ClockSampler`` tags each
sample with the wall-clock time ``nvidia-smi`` took it; ``window(name)`` marks when ``name``
ran, and ``stats(name)`` summarises the samples inside its windows.

Without ``nvidia-smi`` (or for another vendor's GPU) the sampler records nothing and
``stats`` returns None: the numbers are context, never a reason for a bench to fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import threading
import time
from datetime import datetime
from typing import Any, Iterator

FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu"
# the clock-event reasons' field was renamed across drivers
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _query(device_id: str | None) -> list[str] | None:
    """The nvidia-smi command line that samples ``device_id`` (or GPU 0), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    target = [f"--id={device_id}"] if device_id else ["--id=0"]
    for reasons in REASON_FIELDS + ("",):
        fields = FIELDS + (f",{reasons}" if reasons else "")
        command = [smi, *target, f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
        try:
            probe = subprocess.run(command, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if probe.returncode == 0:
            return command
    return None


def device_ids_of(device: Any) -> list[str]:
    """nvidia-smi ids to try for a torch CUDA device: its UUID (immune to
    CUDA_VISIBLE_DEVICES), then its index where no device mask renumbers them."""
    ids = []
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device).uuid)
        ids.append(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            ids.append(str(torch.device(device).index or 0))
    except Exception:
        pass
    return ids


def parse_sample(line: str) -> tuple[float, float, float, float, str] | None:
    """(epoch seconds, SM MHz, watts, degrees C, clock-event reasons) of one CSV line."""
    parts = [p.strip() for p in line.split(",")]
    try:
        stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        return stamp, float(parts[1]), float(parts[2]), float(parts[3]), (
            parts[4] if len(parts) > 4 else "n/a")
    except (ValueError, IndexError):
        return None


class ClockSampler:
    """``nvidia-smi -lms interval_ms`` in the background while it is open (a context
    manager); ``window(name)`` brackets the code whose samples belong to ``name``."""

    def __init__(self, device: Any = None, interval_ms: int = 50):
        self.command = None
        # which GPU nvidia-smi samples: the device's UUID or index, or "0" when neither
        # answered (then the samples may be another GPU's; the stats say so)
        self.nvidia_smi_id: str | None = None
        for device_id in (device_ids_of(device) if device is not None else []) + [None]:
            self.command = _query(device_id)
            if self.command is not None:
                self.nvidia_smi_id = device_id or "0"
                if device is not None and device_id is None:
                    self.nvidia_smi_id = "0 (the device's own id did not answer)"
                break
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, float, float, float, str]] = []
        self.windows: dict[str, list[tuple[float, float]]] = {}
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "ClockSampler":
        if self.command is not None:
            try:
                self._proc = subprocess.Popen([*self.command, "-lms", str(self.interval_ms)],
                                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                              text=True)
            except OSError:  # context only: a sampler that cannot start records nothing
                self._proc = None
                return self
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        # drained continuously: a full pipe would stall nvidia-smi and delay its samples
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            time.sleep(self.interval_ms / 1000.0)  # the last window's trailing sample
            self._proc.terminate()
            self._proc.wait()
            self._reader.join(timeout=1.0)

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[None]:
        """The samples taken while the body runs belong to ``name``."""
        start = time.time()
        try:
            yield
        finally:
            self.windows.setdefault(name, []).append((start, time.time()))

    def stats(self, name: str) -> dict[str, Any] | None:
        """Median SM clock, mean power, peak temperature and the clock-event reasons seen in
        ``name``'s windows (None without samples)."""
        spans = self.windows.get(name, [])
        mine = [s for s in self.samples if any(a <= s[0] <= b for a, b in spans)]
        if not mine:
            return None
        return {"samples": len(mine), "nvidia_smi_id": getattr(self, "nvidia_smi_id", None),
                "sm_mhz_median": statistics.median(s[1] for s in mine),
                "sm_mhz_min": min(s[1] for s in mine),
                "power_w_mean": round(statistics.fmean(s[2] for s in mine), 1),
                "temp_c_max": max(s[3] for s in mine),
                "clock_event_reasons": sorted({s[4] for s in mine})}
