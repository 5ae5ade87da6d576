"""GPU telemetry: on each node, a background thread samples the job's GPUs through NVML once a second into a CSV.

API:
    GpuTelemetry(path, interval_s=1.0, enabled=True, merge=True)   context manager. Enabled on one rank per node
        (local rank 0), it samples the GPUs this process sees into `<path without suffix>/<host>.csv`; with `merge`
        (global rank 0), on exit it writes `path`: every node's rows so far, by time (the phase's export merges
        again once every rank has stopped). `.active` is False (and nothing is written) when disabled, without a
        CUDA device, or without nvidia-ml-py.
    merge_node_files(path)   `path` from the node files beside it (atomic, streamed: one row per node in memory);
        False when there are none
Columns: time (unix s), host, gpu (the CUDA index this process sees), power_w, temperature_c, sm_clock_mhz,
memory_clock_mhz, utilization_gpu_pct, utilization_memory_pct, memory_used_mib, memory_total_mib.

NVML numbers a node's GPUs its own way (PCI order, blind to CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER) and answers
NO_PERMISSION for GPUs outside the job's cgroup: each CUDA device is found by its UUID (a MIG device under its
parent GPU), and a device NVML refuses is left out of the samples (logged once), never the end of a sample. A MIG
device's row holds its own memory; its other readings are blank where NVML gives them only for the whole GPU.
"""
from __future__ import annotations

import csv
import heapq
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


def _node_rows(node: Path, counts: dict):
    """(key, row) of a node file's rows in file order, key = (time, host, GPU); rows cut short by a killed node are
    left out and counted in counts["incomplete"], rows whose key goes back (a clock set back) in counts["unordered"]."""
    with open(node, newline="") as handle:
        reader = csv.reader(handle)
        if next(reader, None) != COLUMNS:
            log.warning("%s: not a telemetry file of this version (header differs); left out", node)
            return
        last = None
        for row in reader:
            try:
                key = (float(row[0]), row[1], int(row[2]))
            except (IndexError, ValueError):
                key = None
            if key is None or len(row) != len(COLUMNS):
                counts["incomplete"] += 1
                continue
            if last is not None and key < last:
                counts["unordered"] += 1
            last = key
            yield key, row


def merge_node_files(path) -> bool:
    """Write `path` from every node's file, rows by time, host, GPU (a row cut short by a killed node is dropped and
    counted). Each node writes its rows in that order, so the files are merged as streams: one row per node in
    memory, whatever the length of the run. False, and nothing written, when no node recorded anything."""
    counts = {"incomplete": 0, "unordered": 0}
    nodes = [_node_rows(node, counts) for node in sorted(node_files(path).glob("*.csv"))]
    rows = heapq.merge(*nodes, key=lambda keyed: keyed[0])  # stable: equal keys keep the node files' order
    first = next(rows, None)
    if first is not None:
        with atomic_path(path) as temporary, open(temporary, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(COLUMNS)
            writer.writerow(first[1])
            writer.writerows(row for _, row in rows)
    if counts["incomplete"]:
        log.warning("%s: %d incomplete telemetry row(s) left out (a node stopped mid-write)", path,
                    counts["incomplete"])
    if counts["unordered"]:
        log.warning("%s: %d telemetry row(s) earlier than the row before them in their node file (the clock was set "
                    "back); kept there, out of time order", path, counts["unordered"])
    return first is not None


def nvml_handle(nvml, cuda_uuid):
    """The NVML handle of the CUDA device of UUID `cuda_uuid` (torch prints it without NVML's "GPU-" or "MIG-"
    prefix): a whole GPU by its UUID, else a MIG device, found under its parent GPU (NVML looks up only whole GPUs
    by UUID). Raises NVMLError (NOT_FOUND) when NVML knows no such device."""
    bare = str(cuda_uuid).removeprefix("GPU-").removeprefix("MIG-")
    try:
        return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{bare}")
    except nvml.NVMLError_NotFound:
        pass
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            parent = nvml.nvmlDeviceGetHandleByIndex(index)
            slots = nvml.nvmlDeviceGetMaxMigDeviceCount(parent)
        except nvml.NVMLError:  # outside the job's cgroup, or no MIG on this GPU
            continue
        for slot in range(slots):
            try:
                device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
            except nvml.NVMLError_NotFound:  # a slot no MIG device holds
                continue
            if nvml.nvmlDeviceGetUUID(device) == f"MIG-{bare}":
                return device
    raise nvml.NVMLError(nvml.NVML_ERROR_NOT_FOUND)


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
            uuid = torch.cuda.get_device_properties(index).uuid
            try:
                devices.append((index, nvml_handle(nvml, uuid)))
            except nvml.NVMLError as error:
                refused = error.value == nvml.NVML_ERROR_NO_PERMISSION
                log.warning("GPU telemetry leaves out GPU %d (%s): NVML %s", index, uuid,
                            "refuses it (outside the job's cgroup?)" if refused else f"error: {error}")
        return devices

    def _read(self, query, handle, *args):
        """One reading; blank where the GPU does not support it (e.g. power on some boards, or a MIG device's
        readings of its whole GPU: NOT_SUPPORTED, INVALID_ARGUMENT by driver)."""
        try:
            return query(handle, *args)
        except (self._nvml.NVMLError_NotSupported, self._nvml.NVMLError_InvalidArgument):
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
