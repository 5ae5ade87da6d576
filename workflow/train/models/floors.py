"""Each attention path's floor (the torch and the GPU it needs), the rule that picks the next path below it and the
warning that says so; torch-free, so that the Snakefile checks the floor at parse time (`snakemake -n`) without
importing torch. workflow/train/models/kernels.py applies them where a job trains (docs/gpu.md's table).

API:
    torch_floor_error(version) -> str | None   the one line a trainer stops with on a torch below TORCH_FLOOR
    FAST_PATHS[family] -> (fast path, torch floor (major, minor), exact path, what the fast path is)
    fallback(fast, floor, exact, capability, torch_version, flash_attn) -> the path that trains
    floor_warning(family, name, why, upgrade, or_flash_attn) -> the one line of a job training `name` instead
    head_floor_warning(family, precision, packed, conda_env) -> str | None   at parse time (`snakemake -n`, rules/
        pretrain.smk): the warning a pretraining job would log at its start about its torch floor, or that it will
        stop (below TORCH_FLOOR), where the head knows the job's torch; the GPU is not known there
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys

FLASH_VARLEN, WINDOWED_FLASH_VARLEN, FLASH_ATTN = "flash_varlen", "flash_varlen (windowed)", "flash_attn_varlen_func"
NESTED_SDPA, ROWS = "nested SDPA", "rows (SDPA with a mask)"
TORCH_FLOOR = (2, 4)  # torch.library.custom_op (flash_varlen); the trainers were run on a real 2.4.1 and 2.6.0
FLASH_CAPABILITY = (8, 0)  # flash kernels (torch's and flash-attn 2's): Ampere and newer; T4 / RTX 20xx are (7, 5)
# family: (its fast path, the torch it needs, its exact path, what the fast path is)
FAST_PATHS = {
    "bert": (FLASH_VARLEN, (2, 7), NESTED_SDPA, "BERT's varlen flash attention with dropout"),
    "modernbert": (WINDOWED_FLASH_VARLEN, (2, 11), ROWS, "ModernBERT's windowed varlen flash attention"),
}
FAST_PATHS["roberta"] = FAST_PATHS["bert"]  # RoBERTa trains BERT's encoder (kit.VarlenAttention)
SLOWER = {NESTED_SDPA: "nested SDPA (exact, ~4x slower)", ROWS: "rows with masks (exact, slower)",
          FLASH_ATTN: "flash-attn's flash_attn_varlen_func"}


def no_flash_gpu(capability) -> bool:
    return capability is not None and tuple(capability) < FLASH_CAPABILITY


def fallback(fast: str, floor: tuple, exact: str, capability, torch_version: tuple, flash_attn: bool) -> str:
    if no_flash_gpu(capability):
        return exact
    if tuple(torch_version) >= floor:
        return fast
    return FLASH_ATTN if flash_attn else exact


def floor_warning(family: str, name: str, why: str, upgrade: str, or_flash_attn: str = "") -> str:
    """The one line a job below its fast path's floor logs, training with `name` instead."""
    _, floor, _, what = FAST_PATHS[family]
    return (f"{what} needs torch >= {floor[0]}.{floor[1]} and compute capability >= 8.0; {why}: training with "
            f"{SLOWER[name]} instead; {upgrade}{or_flash_attn}")


def head_floor_warning(family: str, precision: str, packed: bool, conda_env: str | None) -> str | None:
    """At parse time on the Snakemake head: the warning a pretraining job (model.family `family`, pretrain.precision
    `precision`, packed rows or not) will log at its start on a GPU of compute capability >= 8.0, about its fast
    path's torch floor; or, where that torch is below TORCH_FLOOR, that every training job will stop at its start.
    None when that torch meets both, or meets TORCH_FLOOR and the job's precision is fp32 or its family trains no fast
    path there. The job's torch is the pin of the conda env file `conda_env` (its `torch==` line) when given, else
    this interpreter's (a job without a deployment method runs the python active at submission). The GPU is not known
    here: below compute capability 8.0 the job takes its exact path whatever torch it has, and says so there."""
    from workflow.train.models.family import family as model_family

    fast, floor, exact, _ = FAST_PATHS[family]
    if conda_env is None:
        version_text, where = installed_torch(), f"this interpreter's, {sys.executable}"
        flash_attn = importlib.util.find_spec("flash_attn") is not None  # installed; imported only on a GPU node
        upgrade, or_flash_attn = f"upgrade torch to >= {floor[0]}.{floor[1]}", " (or pip install flash-attn)"
    else:
        pins = _pip_pins(conda_env)
        if "torch" not in pins:
            return None  # no exact pin: the version conda resolves is not known here
        version_text, where, flash_attn = pins["torch"], f"{conda_env}'s pin", "flash-attn" in pins
        upgrade, or_flash_attn = f"pin torch >= {floor[0]}.{floor[1]} in {conda_env}", " (or add flash-attn to it)"
    if below := torch_floor_error(version_text):
        return f"{below} (the jobs' torch: {where}); the data stages run, each training job stops at its start"
    if precision == "fp32" or not model_family(family).unpads(packed, "bf16"):
        return None  # auto: bf16 on a GPU that has it, every GPU with flash kernels does
    trains = fallback(fast, floor, exact, None, major_minor(version_text), flash_attn)
    if trains == fast:
        return None
    return floor_warning(family, trains, f"torch {version_text} lacks it (the jobs' torch: {where})", upgrade,
                          "" if trains == FLASH_ATTN else or_flash_attn)


def _pip_pins(conda_env: str) -> dict[str, str]:
    """{package (lower case, `_` as `-`): version} of the `name==version` lines of a conda env file's pip list."""
    import yaml

    with open(conda_env) as file:
        dependencies = yaml.safe_load(file).get("dependencies") or []
    pip = next((entry["pip"] for entry in dependencies if isinstance(entry, dict) and "pip" in entry), [])
    pins = (re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", str(line).strip()) for line in pip)
    return {pin[1].lower().replace("_", "-"): pin[2] for pin in pins if pin}


def major_minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def torch_floor_error(version: str) -> str | None:
    """The one line a trainer stops with where its torch (`version`) is below TORCH_FLOOR, else None."""
    if major_minor(version) >= TORCH_FLOOR:
        return None
    return (f"torch {version}: snakebert trains with torch >= {TORCH_FLOOR[0]}.{TORCH_FLOOR[1]} (its attention "
            "kernels are torch.library custom ops, new in 2.4); upgrade torch (NGC's PyTorch containers have 2.4 "
            "from 24.07)")


def installed_torch() -> str:
    """The version torch reports: the imported module's where it is imported, else its installed distribution's (read
    without importing it, seconds a parse would otherwise pay)."""
    module = sys.modules.get("torch")
    return str(module.__version__) if module is not None else importlib.metadata.version("torch")
