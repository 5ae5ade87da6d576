"""GPU telemetry on a node NVML numbers its own way, in a job that owns only some of the node's GPUs.

No GPU and no NVML driver here: a stand-in for nvidia-ml-py (the real module's functions' signatures, its error
classes and codes, its result structures) over an 8-GPU node whose job cgroup holds 4 GPUs, which CUDA numbers in
another order than NVML, or MIG devices of one GPU. Proves: each CUDA device's row holds that device's readings
(a MIG device's too), the GPUs outside the cgroup (NO_PERMISSION) do not end a sample, every node writes its own
rows and the run's CSV merges them streaming, byte for byte as a merge in memory, and the report draws a line per
host and GPU.
"""
from __future__ import annotations

import csv
import inspect
import logging
import os
import socket
import sys
import time
import types

import matplotlib
import pytest
import pynvml as real_nvml
import torch

from workflow.report import report
from workflow.train import telemetry

matplotlib.use("Agg")

NODE_GPUS = 8
# The job's cgroup: NVML's GPUs 4-7, which CUDA (FASTEST_FIRST order) numbers 0-3 as NVML's 6, 4, 7, 5.
CUDA_TO_NVML = [6, 4, 7, 5]


def nvml_uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-2222-3333-444455556666"


def mig_uuid(index: int, slot: int) -> str:
    """The UUID NVML (R470 and later) gives the MIG device in `slot` of GPU `index`."""
    return f"MIG-{index:04x}{slot:04x}-aaaa-bbbb-cccc-ddddeeeeffff"


class NvmlStandIn(types.ModuleType):
    """nvidia-ml-py over one node: NVML's indices in PCI order, NO_PERMISSION (raised as the real module raises it)
    for a GPU outside `allowed`, readings that name the GPU (power = 100 W + its NVML index). `mig`: the GPUs in MIG
    mode -> the slots their MIG devices hold; a MIG device has its own memory (2000 MiB + 10 x GPU + slot used) and
    answers NOT_SUPPORTED for its GPU's readings (utilization, power, temperature, clocks)."""

    def __init__(self, allowed, mig=None):
        super().__init__("pynvml")
        for name in dir(real_nvml):  # the real constants, error classes and result structures
            if name.startswith(("NVML_", "NVMLError", "c_nvml")):
                setattr(self, name, getattr(real_nvml, name))
        self.allowed, self.initialised, self.calls = set(allowed), 0, []
        self.mig = mig or {}

    def _handle(self, index):
        if index not in self.allowed:
            raise real_nvml.NVMLError(real_nvml.NVML_ERROR_NO_PERMISSION)
        return ("handle", index)

    def _device(self, handle):
        """The NVML index of a whole GPU's handle; a MIG device's handle refuses its GPU's readings."""
        assert self.initialised and handle[0] in ("handle", "mig"), handle
        if handle[0] == "mig":
            raise real_nvml.NVMLError(real_nvml.NVML_ERROR_NOT_SUPPORTED)
        return handle[1]

    def nvmlInit(self):
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised -= 1

    def nvmlDeviceGetCount(self):
        return NODE_GPUS

    def nvmlDeviceGetHandleByIndex(self, index):
        return self._handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for index in range(NODE_GPUS):
            if uuid == nvml_uuid(index):
                return self._handle(index)
        raise real_nvml.NVMLError(real_nvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetMaxMigDeviceCount(self, device):
        return 7 if device[1] in self.mig else 0  # an A100's or H100's 7 slots

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index):
        if index not in self.mig.get(device[1], ()):
            raise real_nvml.NVMLError(real_nvml.NVML_ERROR_NOT_FOUND)
        return ("mig", device[1], index)

    def nvmlDeviceGetUUID(self, handle):
        return mig_uuid(*handle[1:]) if handle[0] == "mig" else nvml_uuid(handle[1])

    def nvmlDeviceGetUtilizationRates(self, handle):
        return real_nvml.c_nvmlUtilization_t(gpu=90 + self._device(handle), memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        if handle[0] == "mig":
            return real_nvml.c_nvmlMemory_t(total=10 * 2**30, free=0, used=(2000 + 10 * handle[1] + handle[2]) * 2**20)
        return real_nvml.c_nvmlMemory_t(total=80 * 2**30, free=0, used=(1000 + self._device(handle)) * 2**20)

    def nvmlDeviceGetPowerUsage(self, handle):
        return (100 + self._device(handle)) * 1000  # mW

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == real_nvml.NVML_TEMPERATURE_GPU
        return 60 + self._device(handle)

    def nvmlDeviceGetClockInfo(self, handle, type):
        self._device(handle)
        return {real_nvml.NVML_CLOCK_SM: 1980, real_nvml.NVML_CLOCK_MEM: 2619}[type]


@pytest.fixture
def node(monkeypatch):
    """A node of NODE_GPUS GPUs; returns a function that sets the host name, the cgroup, the GPUs in MIG mode and
    the UUIDs of the devices CUDA sees (default: CUDA_TO_NVML's GPUs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def make(host: str, allowed=CUDA_TO_NVML, mig=None, cuda=tuple(nvml_uuid(n) for n in CUDA_TO_NVML)) -> NvmlStandIn:
        stand_in = NvmlStandIn(allowed, mig)
        monkeypatch.setitem(sys.modules, "pynvml", stand_in)
        monkeypatch.setattr(socket, "gethostname", lambda: host)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(cuda))
        # torch prints a device's UUID without NVML's "GPU-" or "MIG-" prefix
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(
            uuid=cuda[index].split("-", 1)[1]))
        return stand_in

    return make


def sample(path, samples: int = 3, **options) -> None:
    """Run the sampler until its node file holds `samples` samples."""
    with telemetry.GpuTelemetry(path, interval_s=0.01, **options) as sampler:
        assert sampler.active
        deadline = time.time() + 10
        while len(rows(sampler.node_path)) < samples * len(sampler._devices) and time.time() < deadline:
            time.sleep(0.01)


def rows(path) -> list[dict]:
    try:
        with open(path, newline="") as handle:
            return list(csv.DictReader(handle))
    except FileNotFoundError:
        return []


def test_the_stand_in_has_nvidia_ml_pys_signatures():
    for name, function in vars(NvmlStandIn).items():
        if name.startswith("nvml"):
            ours = inspect.signature(function.__get__(NvmlStandIn([])))
            assert ours == inspect.signature(getattr(real_nvml, name)), name
    error = real_nvml.NVMLError(real_nvml.NVML_ERROR_NO_PERMISSION)
    assert isinstance(error, real_nvml.NVMLError_NoPermission) and error.value == 4


def test_each_cuda_device_is_sampled_by_its_uuid_while_nvml_refuses_the_gpus_outside_the_job(node, tmp_path):
    stand_in = node("node1")
    with pytest.raises(real_nvml.NVMLError_NoPermission):  # what ended every sample before
        stand_in.nvmlDeviceGetHandleByIndex(0)
    sample(tmp_path / "gpu_telemetry.csv")
    got = rows(tmp_path / "gpu_telemetry.csv")  # one node, merged on exit
    assert got and set(got[0]) == set(telemetry.COLUMNS)
    by_gpu = {}
    for row in got:
        by_gpu.setdefault(int(row["gpu"]), set()).add(
            (row["host"], float(row["power_w"]), int(row["temperature_c"]), int(row["memory_used_mib"])))
    # CUDA device k's readings are those of NVML's GPU CUDA_TO_NVML[k]
    assert by_gpu == {k: {("node1", 100.0 + n, 60 + n, 1000 + n)} for k, n in enumerate(CUDA_TO_NVML)}
    assert stand_in.initialised == 0  # shut down


def test_mig_devices_are_found_under_their_gpu_by_uuid_and_sampled_with_their_own_memory(node, tmp_path, caplog):
    # The job holds NVML's GPU 5, in MIG mode with devices in slots 0 and 2; CUDA sees them as devices 0 (slot 2)
    # and 1 (slot 0). GPU 4 is in MIG mode too, outside the job.
    stand_in = node("node1", allowed=[5], mig={4: [0], 5: [0, 2]}, cuda=[mig_uuid(5, 2), mig_uuid(5, 0)])
    with pytest.raises(real_nvml.NVMLError_NotFound):  # NVML finds only whole GPUs by UUID
        stand_in.nvmlDeviceGetHandleByUUID(f"GPU-{mig_uuid(5, 2).removeprefix('MIG-')}")
    with caplog.at_level(logging.WARNING, logger="workflow.train.telemetry"):
        sample(tmp_path / "gpu_telemetry.csv")
    assert not caplog.records, caplog.text
    got = rows(tmp_path / "gpu_telemetry.csv")
    readings = {(int(row["gpu"]), row["memory_used_mib"], row["memory_total_mib"], row["power_w"],
                 row["utilization_gpu_pct"], row["temperature_c"]) for row in got}
    assert readings == {(0, "2052", "10240", "", "", ""), (1, "2050", "10240", "", "", "")}


def test_a_visible_gpu_nvml_refuses_is_left_out_once_and_the_others_are_sampled(node, tmp_path, caplog):
    node("node1", allowed=[4, 6, 7])  # CUDA's device 3 (NVML 5) answers NO_PERMISSION
    with caplog.at_level(logging.WARNING, logger="workflow.train.telemetry"):
        sample(tmp_path / "gpu_telemetry.csv", samples=5)
    got = rows(tmp_path / "gpu_telemetry.csv")
    assert {int(row["gpu"]) for row in got} == {0, 1, 2}
    assert len({row["time"] for row in got}) >= 5 and len(got) == 3 * len({row["time"] for row in got})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "leaves out GPU 3" in warnings[0] and "refuses" in warnings[0], warnings


def test_every_node_records_its_gpus_and_the_run_csv_merges_them_for_the_report(node, tmp_path):
    path = tmp_path / "run" / "gpu_telemetry.csv"
    node("node2")
    sample(path, merge=False)  # local rank 0 of the second node
    assert not path.exists()
    node("node1")
    sample(path)  # global rank 0: merges on exit
    got = rows(path)
    assert {(row["host"], int(row["gpu"])) for row in got} == {(h, k) for h in ("node1", "node2") for k in range(4)}
    assert [float(row["time"]) for row in got] == sorted(float(row["time"]) for row in got)
    assert sorted(p.name for p in telemetry.node_files(path).iterdir()) == ["node1.csv", "node2.csv"]

    figure = report.telemetry_figure([("phase1", path.parent)])
    labels = {line.get_label() for line in figure.axes[0].get_lines()}
    assert labels == {f"{h} GPU {k}" for h in ("node1", "node2") for k in range(4)}


def test_a_row_cut_short_by_a_killed_node_is_left_out_of_the_merge_and_counted(tmp_path, caplog):
    path = tmp_path / "gpu_telemetry.csv"
    folder = telemetry.node_files(path)
    folder.mkdir()
    header = ",".join(telemetry.COLUMNS)
    (folder / "node1.csv").write_text(f"{header}\n2.0,node1,0,300,60,1980,2619,90,40,1000,81920\n")
    (folder / "node2.csv").write_text(f"{header}\n1.0,node2,0,300,60,1980,2619,90,40,1000,81920\n3.0,node2,0,30")
    with caplog.at_level(logging.WARNING, logger="workflow.train.telemetry"):
        assert telemetry.merge_node_files(path)
    assert [(row["time"], row["host"]) for row in rows(path)] == [("1.0", "node2"), ("2.0", "node1")]
    assert "1 incomplete telemetry row(s) left out" in caplog.text


def test_the_streaming_merge_writes_the_bytes_of_a_merge_holding_every_row(tmp_path, caplog):
    from benchmarks.telemetry_merge import merge_in_memory, write_node_files

    path = tmp_path / "gpu_telemetry.csv"
    write_node_files(path, rows=3 * 2 * 40, nodes=3, gpus=2)  # interleaved: each node's clock a little off
    folder = telemetry.node_files(path)
    with open(folder / "gpu002.csv", "a") as handle:  # killed mid-row, then resumed: the cut row runs into the next
        handle.write("1790000040.007,gpu002,0,30")
    with open(folder / "gpu002.csv", "a") as handle:
        handle.write("1790000041.007,gpu002,0,300.5,60,1980,2619,90,40,1000,81920\n" * 2)  # one key twice
    (folder / "gpu004.csv").write_text("time,host\n1.0,gpu004\n")  # another version's file: left out by both
    with caplog.at_level(logging.WARNING, logger="workflow.train.telemetry"):
        assert telemetry.merge_node_files(path)
    os.symlink(folder, telemetry.node_files(tmp_path / "in_memory.csv"))
    assert merge_in_memory(tmp_path / "in_memory.csv")
    assert path.read_bytes() == (tmp_path / "in_memory.csv").read_bytes()
    assert len(rows(path)) == 3 * 2 * 40 + 1  # the cut row and the row it ran into are one incomplete row
    assert "1 incomplete telemetry row(s) left out" in caplog.text and "out of time order" not in caplog.text


def test_rows_of_a_clock_set_back_are_kept_in_their_nodes_order_and_counted(tmp_path, caplog):
    path = tmp_path / "gpu_telemetry.csv"
    folder = telemetry.node_files(path)
    folder.mkdir()
    header, row = ",".join(telemetry.COLUMNS), "{},{},0,300,60,1980,2619,90,40,1000,81920\n"
    (folder / "node1.csv").write_text(header + "\n" + "".join(row.format(t, "node1") for t in (1.0, 3.0, 2.0, 4.0)))
    (folder / "node2.csv").write_text(header + "\n" + row.format(2.5, "node2"))
    with caplog.at_level(logging.WARNING, logger="workflow.train.telemetry"):
        assert telemetry.merge_node_files(path)
    assert [(r["time"], r["host"]) for r in rows(path)] == [("1.0", "node1"), ("2.5", "node2"), ("3.0", "node1"),
                                                            ("2.0", "node1"), ("4.0", "node1")]
    assert "1 telemetry row(s) earlier than the row before them" in caplog.text
