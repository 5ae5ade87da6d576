"""GPU telemetry: a background thread samples every visible GPU through NVML once a second into a CSV.

API:
    GpuTelemetry(path, interval_s=1.0, enabled=True)   context manager; appends rows to `path` (header when new).
        `.active` is False (and nothing is written) when disabled (e.g. on ranks > 0), without a CUDA device, or
        without nvidia-ml-py.
Columns: time (unix s), gpu, power_w, temperature_c, sm_clock_mhz, memory_clock_mhz, utilization_gpu_pct,
utilization_memory_pct, memory_used_mib, memory_total_mib.
"""
from __future__ import annotations

import csv
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

COLUMNS = ["time", "gpu", "power_w", "temperature_c", "sm_clock_mhz", "memory_clock_mhz", "utilization_gpu_pct",
           "utilization_memory_pct", "memory_used_mib", "memory_total_mib"]


class GpuTelemetry:
    def __init__(self, path, interval_s: float = 1.0, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(path)
        self.interval_s = interval_s
        self.active = False
        self._stop = threading.Event()
        self._thread = None
        self._nvml = None

    def __enter__(self):
        if not self.enabled:
            return self
        try:
            import torch

            if not torch.cuda.is_available():
                return self
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
        except Exception as error:  # no GPU, no driver or no nvidia-ml-py: telemetry is simply absent
            log.info("GPU telemetry off: %s", error)
            return self
        self._nvml = pynvml
        self.active = True
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        self._thread.start()
        return self

    def _sample(self, writer) -> None:
        nvml = self._nvml
        now = round(time.time(), 3)
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            utilization = nvml.nvmlDeviceGetUtilizationRates(handle)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            writer.writerow([
                now, index,
                nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
                utilization.gpu, utilization.memory,
                memory.used // 2**20, memory.total // 2**20,
            ])

    def _run(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "a", newline="") as handle:
            writer = csv.writer(handle)
            if new:
                writer.writerow(COLUMNS)
            while not self._stop.is_set():
                try:
                    self._sample(writer)
                    handle.flush()
                except Exception as error:  # a sampling hiccup must never stop training
                    log.warning("GPU telemetry sample failed: %s", error)
                self._stop.wait(self.interval_s)

    def __exit__(self, *exc):
        if self.active:
            self._stop.set()
            self._thread.join(timeout=5)
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        return False
