"""The measurement both GPU benchmarks share (benchmarks/train_step.py --gpu, benchmarks/modernbert_step.py --gpu):
the device and its CPU stand-ins, our model's variants, timing, MFU, the largest micro-batch that fits, the optimizer
as accumulation amortises it, and the Markdown table a run prints.

Variants of our model (VARIANTS), the same weights and batches:
    eager             the model as written
    compiled          engine.compiled (torch.compile(mode=--compile-mode, dynamic=False)), as pretrain.compile runs it
    compiled+float8   a copy converted by workflow.train.float8.convert_to_float8, then compiled (pretrain.float8);
                      where float8_error says it cannot run, the variant is skipped with that line
MFU = real tokens' FLOPs per second / the card's datasheet dense bf16 peak (accelerator.peak_flops), the FLOPs from
the family's flops_per_sequence at the mean real length and real predictions (padding never counts as work).
"""
from __future__ import annotations

import contextlib
import copy
import gc
import platform
import resource
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from workflow.train import accelerator, engine
from workflow.train.float8 import convert_to_float8, float8_error
from workflow.train.models import kit
from workflow.train.models.fused_loss import fused_mlm_loss_reason
from workflow.train.precision import autocast

VARIANTS = ("eager", "compiled", "compiled+float8")
HF = "hf"  # the name --find-max-micro-batch gives Hugging Face's sides


class Device:
    """The GPU mode's device: CUDA (through workflow.train.accelerator, where every CUDA call lives), or the CPU
    with its stand-ins (no sync, peak RSS, MFU "n/a"), so the GPU mode runs (and is tested) without a GPU."""

    def __init__(self, kind: str):
        self.type = kind
        self.is_cuda = kind == "cuda"
        self.torch = torch.device(kind)

    def available(self) -> bool:
        return accelerator.available() if self.is_cuda else True

    def prepare(self, threads: int) -> None:
        if self.is_cuda:
            accelerator.allow_tf32(True)  # fp32 matmuls outside autocast, as on any Ampere+ run
        else:
            torch.set_num_threads(threads)

    def name(self) -> str:
        if self.is_cuda:
            return f"GPU {accelerator.device_name(self.torch)}"
        return f"CPU {platform.machine()}, {torch.get_num_threads()} threads"

    def sync(self) -> None:
        """Wait for the queued kernels (CUDA runs asynchronously; CPU ops are done when they return)."""
        accelerator.synchronize(self.torch)

    def reset_peak_memory(self) -> None:
        """Free the cache and restart the peak (CUDA); a process's peak RSS cannot be restarted (CPU)."""
        gc.collect()
        accelerator.reset_peak_memory(self.torch)

    def peak_memory(self) -> str:
        if self.is_cuda:
            return f"{accelerator.peak_memory_bytes(self.torch) / 2**30:.1f} GiB"
        return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB RSS"

    def peak_flops(self) -> float | None:
        """The card's datasheet dense bf16 peak (None: a CPU, or a card not in accelerator's table)."""
        return accelerator.peak_flops(accelerator.device_name(self.torch), "bf16") if self.is_cuda else None

    def mfu(self, flops_per_second: float) -> str:
        """Model FLOPs utilisation of the card's datasheet bf16 peak: n/a on CPU or an unknown card."""
        peak = self.peak_flops()
        return f"{flops_per_second / peak:.1%}" if peak else "n/a"

    def peak_line(self) -> str:
        peak = self.peak_flops()
        return f"{peak / 1e12:.1f} TFLOP/s (datasheet dense bf16)" if peak else "n/a (no datasheet peak)"

    def bf16(self):
        """bf16 autocast on this device, as training runs it."""
        return autocast(self.torch, "bf16")

    @contextlib.contextmanager
    def packed_path(self):
        """Packed rows on the unpadded varlen path the model takes on CUDA (kit.VARLEN_DEVICE_TYPES), forced on CPU
        too so that a CPU run exercises the code a GPU run times."""
        saved = kit.VARLEN_DEVICE_TYPES
        kit.VARLEN_DEVICE_TYPES = tuple({*saved, self.type})
        try:
            yield "unpadded varlen"
        finally:
            kit.VARLEN_DEVICE_TYPES = saved


def mlm_loss_path(device: Device) -> str:
    """Which MLM loss summed_mlm_loss(fused=True) runs here, in words."""
    reason = fused_mlm_loss_reason(device.torch)
    return "fused (liger-kernel's fused linear cross-entropy)" if reason is None else f"reference logits ({reason})"


def requested(args) -> tuple[list[str], set[str]]:
    """The variants the flags ask for (eager always; --compile, --float8) and the sides whose largest micro-batch
    --find-max-micro-batch searches."""
    variants = ["eager"] + ["compiled"] * args.compile + ["compiled+float8"] * args.float8
    return variants, set(args.find_max_micro_batch.split(",")) if args.find_max_micro_batch else set()


def variant_models(model: torch.nn.Module, device: Device, compile_mode: str, variants=VARIANTS):
    """(variant, the module it calls, or the one line why it is skipped: a str, or the exception that building it
    raised) in turn, each made when the previous one is done with: compiled+float8 converts a copy, which then exists
    only while it is measured."""
    # Each variant and each micro-batch size searched is one more compilation of the same forward (the limit's name
    # in torch 2.6: cache_size_limit).
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
        try:
            if variant == "eager":
                built = model
            elif variant == "compiled":
                built = engine.compiled(model, compile_mode, device.torch)
            else:
                built = float8_error(device.torch) or engine.compiled(convert_to_float8(copy.deepcopy(model)),
                                                                       compile_mode, device.torch)
        except Exception as error:  # noqa: BLE001: the side's row says so (failed_row)
            traceback.print_exc()
            built = error
        yield variant, built


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def timed(fn, sync) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def timed_steps(step, batches: list, warmup: int, device: Device) -> tuple[float, int]:
    """(seconds of `step` over every batch, graphs compiled meanwhile), after `warmup` untimed steps on the batches in
    turn (a compiled variant compiles there). One sync at each end."""
    for index in range(warmup):
        step(batches[index % len(batches)])
    graphs = compiled_graphs()
    return timed(lambda: [step(b) for b in batches], device.sync), compiled_graphs() - graphs


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def largest_micro_batch(run_once, start: int, cap: int, device: Device) -> str:
    """The largest micro-batch that ran, doubling from `start` until an out-of-memory error or `cap`: `run_once(rows)`
    runs one step of `rows` rows; memory is freed between tries. "N" (the next size ran out of memory), ">= N (cap)",
    or "< start" when even `start` did not fit."""
    largest, rows = None, start
    while rows <= cap:
        out_of_memory = False
        try:
            run_once(rows)
            device.sync()
        except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
            if not is_out_of_memory(error):
                raise
            out_of_memory = True  # freed below, once the exception's frames (holding tensors) are gone
        device.reset_peak_memory()
        if out_of_memory:
            return str(largest) if largest else f"< {start}"
        largest, rows = rows, rows * 2
    return f">= {largest} (cap {cap})"


def searched(name: str, chosen: set[str]) -> bool:
    """Whether --find-max-micro-batch's set (variant names, "hf", or "all") includes side `name`."""
    return "all" in chosen or name in chosen


@dataclass
class Row:
    """One side of a run's table (`failed`: the side raised; its note says what)."""
    side: str
    real_tokens_per_s: float | None = None
    mfu: str = ""
    peak_memory: str = ""
    max_micro_batch: str = "not searched"
    note: str = ""
    failed: bool = False

    def cells(self) -> list[str]:
        if self.real_tokens_per_s is None:
            return [self.side, "failed" if self.failed else "skipped", "", "", "", self.note]
        return [self.side, f"{self.real_tokens_per_s:,.0f}", self.mfu, self.peak_memory, self.max_micro_batch,
                self.note]

    def line(self) -> str:
        return "| " + " | ".join(self.cells()) + " |"


TABLE_HEADER = ("side", "real tokens/s per GPU", "MFU", "peak memory", "largest micro-batch", "note")


def table(rows: list[Row]) -> str:
    """The sides as one Markdown table (numbers right-aligned)."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    return "\n".join(lines + [row.line() for row in rows])


@contextlib.contextmanager
def side_guard(rows: list[Row], side: str, device: Device):
    """One side's measurement, which appends its row to `rows`: where it raises, the row says so (the exception's
    type and first line; the traceback on stderr), memory is freed and the run goes on to the next side, so one
    side's failure (a compile error, out of memory) never loses the others' figures. Each row is printed as it is
    added (`measured: | ... |`), so a run stopped from outside keeps the rows it measured."""
    count = len(rows)
    try:
        yield
    except Exception as error:  # noqa: BLE001: reported in the row and the exit status (exit_status)
        traceback.print_exc()
        rows.append(failed_row(side, error))
        device.reset_peak_memory()
    for row in rows[count:]:
        print(f"measured: {row.line()}", flush=True)


@dataclass(frozen=True)
class Work:
    """What every side of one table runs: its micro-batches' real tokens and sequences (rows), one sequence's FLOPs,
    and the micro-batch size the largest-micro-batch search starts from and stops at."""
    real_tokens: int
    sequences: int
    flops_per_sequence: float
    micro_batch: int
    max_micro_batch_cap: int


def measured(rows: list[Row], side: str, step, batches: list, warmup: int, device: Device, work: Work,
             one_step=None) -> float | None:
    """`step` timed over `batches` (timed_steps) into a row of `rows`: real tokens/s, MFU, peak memory and, given
    `one_step` (rows -> one step of a micro-batch of that many rows), the largest micro-batch. Returns the seconds, or
    None where the side failed (side_guard: its row says why)."""
    seconds = None
    with side_guard(rows, side, device):
        device.reset_peak_memory()
        seconds, recompiled = timed_steps(step, batches, warmup, device)
        row = Row(side, work.real_tokens / seconds, device.mfu(work.sequences / seconds * work.flops_per_sequence),
                  device.peak_memory(), note=f"{len(batches)} micro-batches" + (
                      f", graphs compiled while timed: {recompiled}" if "compiled" in side else ""))
        if one_step is not None:
            row.max_micro_batch = largest_micro_batch(one_step, work.micro_batch, work.max_micro_batch_cap, device)
        rows.append(row)
    return seconds


def failed_row(side: str, error: BaseException) -> Row:
    """The row of a side that raised `error`: its type and first line."""
    first_line = (str(error).strip().splitlines() or [""])[0][:200]
    return Row(side, note=f"failed: {type(error).__name__}: {first_line}", failed=True)


def exit_status(rows: list[Row]) -> int:
    """1 where a side failed (the run's table still printed), else 0."""
    failed = [row.side for row in rows if row.failed]
    if failed:
        print(f"failed sides: {', '.join(failed)}", file=sys.stderr)
    return int(bool(failed))


def skipped_row(side: str, reason: str) -> Row:
    print(f"skipped {side}: {reason}")
    return Row(side, note=reason)


def optimizer_ms(optimizer_step, params, repeats: int, device: Device) -> float:
    """Median milliseconds of `optimizer_step()` over `repeats` steps, each after fresh random gradients on `params`
    (set untimed; one untimed step first creates the optimizer's state)."""
    def with_gradients():
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
    with_gradients()
    optimizer_step()
    samples = []
    for _ in range(repeats):
        with_gradients()
        samples.append(timed(optimizer_step, device.sync))
    return statistics.median(samples) * 1e3


def micro_batch_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def micro_batch_text(seconds: float | None) -> str:
    """Eager's time a micro-batch, in words (None: eager failed)."""
    return "(failed: no time)" if seconds is None else f"{seconds * 1e3:.1f} ms a micro-batch"


def optimizer_table(micro_batch_ms: float | None, accumulation: int, optimizers: dict[str, float | str]) -> str:
    """Optimizers' ms per optimizer step and their share of a global step: `accumulation` micro-batches of
    `micro_batch_ms` (eager, forward + loss + backward; None: eager failed, no share) plus one optimizer step. A str
    value is why one did not run."""
    lines = ["| optimizer | ms per optimizer step | micro-batches per step | share of the step |",
             "| --- | ---: | ---: | ---: |"]
    for name, ms in optimizers.items():
        if isinstance(ms, str):
            lines.append(f"| {name} | not run: {ms} | {accumulation} | |")
        else:
            share = "n/a" if micro_batch_ms is None else f"{ms / (accumulation * micro_batch_ms + ms):.3%}"
            lines.append(f"| {name} | {ms:.2f} | {accumulation} | {share} |")
    return "\n".join(lines)
