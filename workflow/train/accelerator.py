"""The one place of the CUDA-only calls of training (torch.cuda, apex, SDPA's kernel choice, datasheet peaks), so that
every branch behind them runs on CPU in tests with stand-ins keeping the real APIs' signatures and device counts
(tests/test_gpu_seam.py); everything outside this module calls these functions, never torch.cuda itself.

API:
    cuda                          the torch.cuda module (a test swaps in a stand-in with N visible devices)
    configure_process(deterministic)   before CUDA starts: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the token
                                  count changes every micro-batch), and for deterministic runs CUBLAS_WORKSPACE_CONFIG
                                  plus torch.use_deterministic_algorithms; a value the user set wins
    available() / device_count() / set_device(device) / device_name(device) / bf16_native(device)
    compute_capability(device) -> (major, minor) | None   None off CUDA
    tf32_native(device) / allow_tf32(enabled)   TF32 tensor cores (compute capability >= 8.0); fp32 matmuls and
                                  convolutions on them
    full_fp32()                   a context in which fp32 matmuls and convolutions run in full fp32 (no TF32), as a
                                  comparison of fp32 results needs; the settings before it restored after
    rng_state(device) / set_rng_state(state, device)   the CUDA generator of this rank's own device only: a
                                  checkpoint restores onto any number of visible devices
    synchronize(device)           wait for the queued kernels (nothing on CPU)
    host_buffer(device) / record_event(device) / wait_event(event)   a host tensor a device value is copied into
                                  behind the queued work (pinned on CUDA), and the event that says it has arrived
    counting_host_syncs(device) -> list   within it, each call that makes the host wait for the device: on CUDA
                                  what its sync debug mode reports, on CPU the reads that would wait on CUDA
                                  (DeviceReads, a torch function mode)
    reset_peak_memory(device) / peak_memory_bytes(device)
    fused_lamb(device) -> (class | None, reason)   apex FusedLAMB where it can run (CUDA, apex importable)
    jagged(values, offsets, min_seqlen, max_seqlen)   a nested jagged tensor, its extremes given where torch takes them
                                  (>= 2.5)
    attention_kernel(device, dtype, head_size, family) -> str   the unpadded attention kernel that trains
                                  (workflow.train.models.kernels: its torch and GPU floors); for nested SDPA, SDPA's
                                  first usable kernel for nested (varlen) q, k, v: "flash" | "efficient" | "math"
                                  ("math" off CUDA)
    peak_flops(device_name, math) -> float | None   the card's datasheet dense peak (FLOP/s) for the matmuls' math
                                  (bf16, fp16, tf32, fp32), by NVML's exact device name; None: unknown
    host_syncs(device, run) -> str | None   what made `run()` wait for the device (CUDA's sync debug mode "error"):
                                  "" none, else the error; None off CUDA (nothing to wait for)
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os

import torch

from workflow.train.models.floors import torch_floor_error

# every trainer imports this module before any other of torch's users: below the floor, one line, not a traceback
if _below_floor := torch_floor_error(torch.__version__):
    raise SystemExit(f"error: {_below_floor}")

log = logging.getLogger(__name__)

cuda = torch.cuda
FUSED_LAMB_DEVICE_TYPES = ("cuda",)  # apex's kernels are CUDA kernels; a test adds "cpu" beside a stand-in FusedLAMB
ALLOCATOR = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
CUBLAS = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what cuBLAS needs for reproducible matmuls (CUDA >= 10.2)

# Dense (no sparsity) tensor-core peaks in TFLOP/s by the exact name NVML reports (torch.cuda.get_device_name,
# nvidia-smi): bf16/fp16, tf32 (what fp32 matmuls run in from compute capability 8.0), fp32 where no TF32 exists.
# Datasheets give the sparse figure (2:4 structured sparsity) with an asterisk; dense is half of it. A card not named
# here has no peak ("unknown"): parts of one family differ by 15-25% (clocks, power limit), so none is guessed.
_H100_SXM = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7}  # NVIDIA H100 Tensor Core GPU datasheet, column H100 SXM
_H100_NVL = {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5}  # NVIDIA H100 Tensor Core GPU datasheet, column H100 NVL
_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0}  # NVIDIA A100 Tensor Core GPU datasheet (all four parts)
DATASHEET_TFLOPS = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0},  # H100 datasheet (2022), column H100 PCIe
    "NVIDIA H200": _H100_SXM,  # NVIDIA H200 Tensor Core GPU datasheet, column H200 SXM (the H100 SXM's compute)
    "NVIDIA H200 NVL": _H100_NVL,  # NVIDIA H200 Tensor Core GPU datasheet, column H200 NVL
    "NVIDIA GH200 480GB": _H100_SXM,  # NVIDIA GH200 Grace Hopper Superchip datasheet (its H100's figures)
    "NVIDIA B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0},  # NVIDIA HGX B200 datasheet, per GPU
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0},  # NVIDIA L40S datasheet
    "NVIDIA L40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5},  # NVIDIA L40 datasheet
    "NVIDIA L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0},  # NVIDIA L4 Tensor Core GPU datasheet
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5},  # NVIDIA A10 Tensor Core GPU datasheet
    "Tesla V100-SXM2-16GB": {"fp16": 125.0, "fp32": 15.7},  # NVIDIA V100 Tensor Core GPU datasheet, V100 SXM2
    "Tesla V100-SXM2-32GB": {"fp16": 125.0, "fp32": 15.7},
    "Tesla V100-PCIE-16GB": {"fp16": 112.0, "fp32": 14.0},  # NVIDIA V100 datasheet, V100 PCIe
    "Tesla V100-PCIE-32GB": {"fp16": 112.0, "fp32": 14.0},
}


def configure_process(deterministic: bool) -> None:
    """Environment of CUDA's allocator and cuBLAS (read when CUDA starts: call this first), deterministic kernels."""
    os.environ.setdefault(*ALLOCATOR)
    if deterministic:
        os.environ.setdefault(*CUBLAS)
        torch.use_deterministic_algorithms(True)


def available() -> bool:
    return cuda.is_available()


def device_count() -> int:
    return cuda.device_count()


def set_device(device: torch.device) -> None:
    cuda.set_device(device)


def device_name(device: torch.device) -> str | None:
    return cuda.get_device_name(device) if device.type == "cuda" else None


def bf16_native(device: torch.device) -> bool:
    # Not emulated bf16 (V100 "supports" it at a fraction of fp32 speed): native on compute capability >= 8.
    return device.type == "cuda" and cuda.is_bf16_supported(including_emulation=False)


def compute_capability(device: torch.device) -> tuple[int, int] | None:
    return tuple(cuda.get_device_capability(device)) if device.type == "cuda" else None


def tf32_native(device: torch.device) -> bool:
    """TF32 tensor cores: Ampere and newer (compute capability >= 8.0)."""
    return device.type == "cuda" and compute_capability(device) >= (8, 0)


def allow_tf32(enabled: bool) -> None:
    """fp32 matmuls (cuBLAS) and convolutions (cuDNN) on TF32 tensor cores: fp32's range, a 10-bit mantissa."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


@contextlib.contextmanager
def full_fp32():
    """fp32 matmuls and convolutions in full fp32 within the block (a trainer in fp32 leaves TF32 on: 1e-3 relative
    rounding, beyond a 1e-4 comparison); the settings before it restored after."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    allow_tf32(False)
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def rng_state(device: torch.device):
    """The CUDA generator state of `device` (this rank's), None off CUDA. Never all visible devices' states: a
    resume may see fewer (8-GPU nodes, then 4), and set_rng_state_all would raise IndexError there."""
    return cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state, device: torch.device) -> None:
    if state is not None and device.type == "cuda":
        cuda.set_rng_state(state, device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        cuda.synchronize(device)


def host_buffer(device: torch.device) -> torch.Tensor:
    """A float32 scalar in host memory that a copy from `device` (of a float32) may fill behind the queued work (pinned
    on CUDA: a copy into pageable memory would wait)."""
    return torch.zeros((), pin_memory=device.type == "cuda")


def record_event(device: torch.device):
    """An event after the work queued on `device` so far (None on CPU: its work is done when queued)."""
    if device.type != "cuda":
        return None
    event = cuda.Event()
    event.record()
    return event


def wait_event(event) -> None:
    """Wait until the work before `event` is done; the work queued after it keeps running."""
    if event is not None:
        event.synchronize()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        cuda.empty_cache()
        cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    return cuda.max_memory_allocated(device) if device.type == "cuda" else None


def fused_lamb(device: torch.device):
    """(apex's FusedLAMB class, "") where it can run, else (None, why not)."""
    if device.type not in FUSED_LAMB_DEVICE_TYPES:
        return None, f"apex FusedLAMB runs on CUDA only (the model is on {device.type})"
    try:
        from apex.optimizers import FusedLAMB  # type: ignore
    except ImportError as error:
        return None, f"apex is not importable ({error})"
    return FusedLAMB, ""


def jagged(values: torch.Tensor, offsets: torch.Tensor, min_seqlen: int, max_seqlen: int) -> torch.Tensor:
    """A nested jagged tensor of `values` cut at `offsets`, its extremes given where torch takes them (2.5 and later;
    CUDA's SDPA would read each from the device, a host sync per call); torch 2.4 has no such arguments."""
    if jagged_takes_extremes():
        return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=min_seqlen, max_seqlen=max_seqlen)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


@functools.cache
def jagged_takes_extremes() -> bool:  # read when first asked: torch 2.3 has no nested_tensor_from_jagged at all
    return "max_seqlen" in inspect.signature(torch.nested.nested_tensor_from_jagged).parameters


def attention_kernel(device: torch.device, dtype: torch.dtype, head_size: int, family: str, heads: int = 2) -> str:
    """The kernel the unpadded attention of `family` trains with on `device` (workflow.train.models.kernels); for
    nested SDPA the first kernel SDPA can run for nested (variable-length) q, k, v of this dtype and head size, in the
    order nested tensors' SDPA prefers them (torch/nested/_internal/sdpa.py)."""
    from workflow.train.models import kernels  # (here: kernels reads the device's capability through this module)
    from workflow.train.models.flash_varlen import runs_flash_varlen

    path = kernels.trained_path(family, device, dtype)
    if path == kernels.FLASH_VARLEN and not runs_flash_varlen(torch.empty(0, heads, head_size, device=device,
                                                                          dtype=dtype)):
        path = kernels.NESTED_SDPA  # a head size the flash kernels do not take
    if path != kernels.NESTED_SDPA:
        return path
    if device.type != "cuda":
        return "math"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    values = torch.zeros(6, heads, head_size, device=device, dtype=dtype)
    offsets = torch.tensor([0, 2, 6], device=device)
    q = jagged(values, offsets, 2, 4).transpose(1, 2)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        with contextlib.suppress(RuntimeError), sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, q, q)
            return name
    return "math"


def peak_flops(name: str | None, math: str) -> float | None:
    """FLOP/s of the card NVML calls `name` for matmuls in `math` (bf16, fp16, tf32, fp32) from its datasheet (None:
    unknown, the card or its math not in DATASHEET_TFLOPS)."""
    peak = DATASHEET_TFLOPS.get((name or "").strip(), {}).get(math)
    return peak * 1e12 if peak else None


def host_syncs(device: torch.device, run) -> str | None:
    """"" when `run()` never waits for `device`, else what CUDA's sync debug mode reports; None off CUDA."""
    if device.type != "cuda":
        return None
    synchronize(device)  # work queued before is not `run`'s
    cuda.set_sync_debug_mode("error")
    try:
        run()
        return ""
    except RuntimeError as error:
        return str(error).splitlines()[0]
    finally:
        cuda.set_sync_debug_mode("default")


# What waits for the device on CUDA, read on CPU: a value read back, or a tensor built on the device from host memory.
DEVICE_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
                torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class DeviceReads(torch.overrides.TorchFunctionMode):
    """The CPU's count, into `calls`: each read of DEVICE_READS, and torch.tensor(..., device=...) (a copy from
    pageable memory)."""

    def __init__(self, calls: list | None = None):
        super().__init__()
        self.calls = [] if calls is None else calls

    def counted(self, func, args, kwargs) -> bool:
        return func in DEVICE_READS or (func is torch.tensor and kwargs.get("device") is not None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counted(func, args, kwargs):
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_host_syncs(device: torch.device):
    """A list of what made the host wait for `device` within the block: CUDA's sync debug mode's warnings on CUDA;
    on CPU (nothing waits there) the calls that would wait on CUDA, so that a CPU test sees them."""
    calls: list = []
    if device.type != "cuda":
        with DeviceReads(calls):
            yield calls
        return
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cuda.set_sync_debug_mode("warn")
        try:
            yield calls
        finally:
            cuda.set_sync_debug_mode("default")
            calls.extend(str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message))
