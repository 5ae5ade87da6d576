"""GPU telemetry: on each node, a background thread samples the job's GPUs through NVML once a second into a CSV.

API:
    GpuTelemetry(path, interval_s=1.0, enabled=True, merge=True)   context manager. Enabled on one rank per node
        (local rank 0), it samples the GPUs this process sees into `<path without suffix>/<host>.csv`; with `merge`
        (global rank 0), on exit it writes `path`: every node's rows so far, by time (the phase's export merges
        again once every rank has stopped). `.active` is False (and nothing is written) when disabled, without a
        CUDA device, or without nvidia-ml-py.
    merge_node_files(path)   `path` from the node files beside it (atomic); False when there are none
Columns: time (unix s), host, gpu (the CUDA index this process sees), power_w, temperature_c, sm_clock_mhz,
memory_clock_mhz, utilization_gpu_pct, utilization_memory_pct, memory_used_mib, memory_total_mib.

NVML numbers a node's GPUs its own way (PCI order, blind to CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER) and answers
NO_PERMISSION for GPUs outside the job's cgroup: each CUDA device is found by its UUID, and a device NVML refuses is
left out of the samples (logged once), never the end of a sample.
"""
from __future__ import annotations

import csv
import logging
import socket
import threading
import time
from pathlib import Path

from workflow.atomic import atomic_path

log = logging.getLogger(__name__)

COLUMNS = ["time", "host", "gpu", "power_w", "temperature_c", "sm_clock_mhz", "memory_clock_mhz",
           "utilization_gpu_pct", "utilization_memory_pct", "memory_used_mib", "memory_total_mib"]


def node_files(path) -> Path:
    """The folder of the node files of the telemetry CSV `path` (run_dir/gpu_telemetry.csv -> run_dir/gpu_telemetry)."""
    return Path(path).with_suffix("")


def merge_node_files(path) -> bool:
    """Write `path` from every node's file (rows by time, host, GPU; a row cut short by a killed node is dropped and
    counted). False, and nothing written, when no node recorded anything."""
    rows, dropped = [], 0
    for node in sorted(node_files(path).glob("*.csv")):
        with open(node, newline="") as handle:
            reader = csv.reader(handle)
            if next(reader, None) != COLUMNS:
                log.warning("%s: not a telemetry file of this version (header differs); left out", node)
                continue
            for row in reader:
                if len(row) != len(COLUMNS):
                    dropped += 1
                    continue
                rows.append(((float(row[0]), row[1], int(row[2])), row))
    if dropped:
        log.warning("%s: %d incomplete telemetry row(s) left out (a node stopped mid-write)", path, dropped)
    if not rows:
        return False
    rows.sort(key=lambda r: r[0])
    with atomic_path(path) as temporary, open(temporary, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(row for _, row in rows)
    return True


def nvml_uuid(cuda_uuid) -> str:
    """NVML's form of a CUDA device UUID (torch prints it without NVML's "GPU-" prefix)."""
    text = str(cuda_uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


class GpuTelemetry:
    def __init__(self, path, interval_s: float = 1.0, enabled: bool = True, merge: bool = True):
        self.enabled, self.merge = enabled, merge
        self.path = Path(path)
        self.node_path = node_files(path) / f"{socket.gethostname()}.csv"
        self.interval_s = interval_s
        self.active = False
        self._stop = threading.Event()
        self._thread = None
        self._nvml = None
        self._devices: list[tuple[int, object]] = []  # (CUDA index, NVML handle)

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
        self._devices = self._handles(torch)
        if not self._devices:
            log.warning("GPU telemetry off: NVML answers for none of the %d visible GPU(s)", torch.cuda.device_count())
            self._shutdown()
            return self
        self.active = True
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        self._thread.start()
        return self

    def _handles(self, torch) -> list[tuple[int, object]]:
        """(CUDA index, NVML handle) of every visible device NVML lets us read, by UUID; the others logged once."""
        nvml, devices = self._nvml, []
        for index in range(torch.cuda.device_count()):
            uuid = nvml_uuid(torch.cuda.get_device_properties(index).uuid)
            try:
                devices.append((index, nvml.nvmlDeviceGetHandleByUUID(uuid)))
            except nvml.NVMLError as error:
                refused = error.value == nvml.NVML_ERROR_NO_PERMISSION
                log.warning("GPU telemetry leaves out GPU %d (%s): NVML %s", index, uuid,
                            "refuses it (outside the job's cgroup?)" if refused else f"error: {error}")
        return devices

    def _read(self, query, handle, *args):
        """One reading; blank where the GPU does not support it (e.g. power on some boards)."""
        try:
            return query(handle, *args)
        except self._nvml.NVMLError_NotSupported:
            return ""

    def _sample(self, writer) -> None:
        nvml = self._nvml
        now, host = round(time.time(), 3), socket.gethostname()
        for index, handle in list(self._devices):
            try:
                utilization = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
                memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
                power = self._read(nvml.nvmlDeviceGetPowerUsage, handle)
                row = [now, host, index, power / 1000.0 if power != "" else "",
                       self._read(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU),
                       self._read(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
                       self._read(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_MEM),
                       *((utilization.gpu, utilization.memory) if utilization != "" else ("", "")),
                       *((memory.used // 2**20, memory.total // 2**20) if memory != "" else ("", ""))]
            except nvml.NVMLError as error:  # refused or lost: leave it out, never end the others' sample
                log.warning("GPU telemetry leaves out GPU %d from now on: NVML error: %s", index, error)
                self._devices.remove((index, handle))
                continue
            writer.writerow(row)

    def _run(self) -> None:
        self.node_path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.node_path.exists() or self.node_path.stat().st_size == 0
        with open(self.node_path, "a", newline="") as handle:
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

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass

    def __exit__(self, *exc):
        if self.active:
            self._stop.set()
            self._thread.join(timeout=5)
            self._shutdown()
        if self.enabled and self.merge:  # every node's rows so far (the export merges the rest)
            merge_node_files(self.path)
        return False
