"""GPU telemetry on a node NVML numbers its own way, in a job that owns only some of the node's GPUs.

No GPU and no NVML driver here: a stand-in for nvidia-ml-py (the real module's functions' signatures, its error
classes and codes, its result structures) over an 8-GPU node whose job cgroup holds 4 GPUs, which CUDA numbers in
another order than NVML. Proves: each CUDA device's row holds that device's readings, the GPUs outside the cgroup
(NO_PERMISSION) do not end a sample, every node writes its own rows and the run's CSV merges them, and the report
draws a line per host and GPU.
"""
from __future__ import annotations

import csv
import inspect
import logging
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


class NvmlStandIn(types.ModuleType):
    """nvidia-ml-py over one node: NVML's indices in PCI order, NO_PERMISSION (raised as the real module raises it)
    for a GPU outside `allowed`, readings that name the GPU (power = 100 W + its NVML index)."""

    def __init__(self, allowed):
        super().__init__("pynvml")
        for name in dir(real_nvml):  # the real constants, error classes and result structures
            if name.startswith(("NVML_", "NVMLError", "c_nvml")):
                setattr(self, name, getattr(real_nvml, name))
        self.allowed, self.initialised, self.calls = set(allowed), 0, []

    def _handle(self, index):
        if index not in self.allowed:
            raise real_nvml.NVMLError(real_nvml.NVML_ERROR_NO_PERMISSION)
        return ("handle", index)

    def _device(self, handle):
        assert self.initialised and handle[0] == "handle", handle
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

    def nvmlDeviceGetUtilizationRates(self, handle):
        return real_nvml.c_nvmlUtilization_t(gpu=90 + self._device(handle), memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
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
    """A node of NODE_GPUS GPUs; CUDA sees CUDA_TO_NVML; returns a function that sets the host name and cgroup."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(CUDA_TO_NVML))
    # torch prints a device's UUID without NVML's "GPU-" prefix
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(
        uuid=nvml_uuid(CUDA_TO_NVML[index]).removeprefix("GPU-")))

    def make(host: str, allowed=CUDA_TO_NVML) -> NvmlStandIn:
        stand_in = NvmlStandIn(allowed)
        monkeypatch.setitem(sys.modules, "pynvml", stand_in)
        monkeypatch.setattr(socket, "gethostname", lambda: host)
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
