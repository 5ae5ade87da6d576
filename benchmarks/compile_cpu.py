"""Benchmark: `pretrain.compile` on CPU for every family, eager and compiled side by side: one compilation and no
graph break over micro-batches of different packings, and a compiled step's time against eager's.

    python benchmarks/compile_cpu.py                  # every family, both paths, 100 micro-batches each (~10 min)
    python benchmarks/compile_cpu.py --families bert --paths rows --batches 4 --backend aot_eager
                                                      # the smoke run of tests/test_benchmarks.py
    python benchmarks/compile_cpu.py --size real --families bert,modernbert --batches 4 --rows 1 --seq 512 \
        --vocab 50368 --backend aot_eager --threads 2  # the GPU presets' graphs (~6 min on 2 cores)

Per family (the registry's, workflow.train.models.family): its CPU preset (bert "tiny", modernbert
"modernbert-tiny", roberta "roberta-tiny"), or with `--size real` the preset a GPU trains (bert "bert-large",
modernbert "modernbert-base" with its own special ids, roberta "roberta-base": the graphs at their real depth and
width), sized to --vocab, dropout as the preset has it (0.1), in training mode.
Its micro-batches: --batches of --rows rows of --seq tokens, Wikipedia-like instances (benchmarks/train_step.py's
generator: a share short, the rest near full) packed as the pack stage packs them (workflow.data.pack, gapfill,
`auto` slots), then the family's host_indices, as the loader hands them to training. Each micro-batch is a different
packing (the table counts them).

Paths:
    rows     what a CPU run trains: fp32, rows with block-diagonal attention masks
    varlen   the graph a GPU run compiles: bf16 autocast, rows laid end to end through flash_varlen's custom ops
             (their exact CPU reference), sequence offsets whose count varies between micro-batches
Sides, on the same weights and micro-batches, taking turns at each micro-batch so that machine noise hits them alike:
    eager
    compiled                   engine.compiled, as pretrain.compile runs it (on CPU, dropout through aten's
                               generator: inductor's fallback_random)
    compiled, inductor's RNG   the same with inductor's own random numbers (options fallback_random off), as
                               engine.compiled ran before (inductor only)
A step is forward, the MLM (+ NSP) loss and backward, as training computes them (no optimizer: it is not compiled).
Per side: the median process CPU time of a step (threads: --threads), real tokens/s over all micro-batches, the
graphs compiled (its first step compiles; any more is a recompilation), graph breaks, and its first step's seconds
(the compilation). The goals (issue 43): 1 graph and 0 breaks per compiled side, on both paths; compiled's step
time <= eager's, on the path a CPU trains (rows).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch._dynamo.utils import counters  # noqa: E402

from benchmarks.gpu_measure import Device  # noqa: E402
from benchmarks.train_step import instances  # noqa: E402
from workflow.data.pack import AUTO, pack_arrays, sequence_slots  # noqa: E402
from workflow.train import engine  # noqa: E402
from workflow.train.models.family import FAMILIES, ModelSettings, family as model_family  # noqa: E402
from workflow.train.precision import autocast  # noqa: E402
from workflow.train.pretrain import pretraining_forward  # noqa: E402
from workflow.train.pretraining_data import make_batch, padded  # noqa: E402

PRESETS = {"cpu": {"bert": "tiny", "modernbert": "modernbert-tiny", "roberta": "roberta-tiny"},
           "real": {"bert": "bert-large", "modernbert": "modernbert-base", "roberta": "roberta-base"}}
# The CPU presets' special ids, where the family's own lie beyond a small vocab (ModernBERT's are 50,280-50,284).
SPECIAL_IDS = {"modernbert": dict(pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3)}
PATHS = ("rows", "varlen")
EAGER, COMPILED, INDUCTOR_RNG = "eager", "compiled", "compiled, inductor's RNG"


def build(name: str, vocab: int, seq: int, size: str = "cpu"):
    """The family's preset of `size` (config, model) sized to `vocab`, in training mode."""
    special_ids = SPECIAL_IDS.get(name, {}) if size == "cpu" else {}
    keys = {"family": name, "preset": PRESETS[size][name], "architecture": special_ids}
    config, model = model_family(name).build(ModelSettings.from_config(keys), None, vocab, seq)
    return config, model.train()


def micro_batches(name: str, config, args) -> list[dict]:
    """`args.batches` micro-batches of `args.rows` packed rows (see the module docstring), host indices included."""
    predictions = max(1, round(args.seq * 0.15))
    slots = sequence_slots(AUTO, args.seq)
    host_indices = model_family(name).host_indices
    batches, seed = [], 0
    while len(batches) < args.batches:
        arrays = instances(config, args.seq, predictions, args.rows * args.batches * 2, seed=seed)
        packed = pack_arrays(arrays, slots, masked_lm_prob=0.15)
        for start in range(0, len(packed["input_ids"]) - args.rows + 1, args.rows):
            rows = {key: values[start:start + args.rows] for key, values in packed.items()}
            batches.append(host_indices(make_batch(*padded(rows, args.rows))))
        seed += 1
    return batches[:args.batches]


def packings(batches: list[dict]) -> int:
    """How many micro-batches differ in how their rows are packed (the rows' sequence numbers)."""
    return len({b["attention_mask"].numpy().tobytes() for b in batches})


def graphs_and_breaks() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


class Side:
    """One side of the table: its module and what it measured."""

    def __init__(self, name: str, module):
        self.name, self.module = name, module
        self.seconds: list[float] = []
        self.graphs = self.breaks = 0
        self.first_step_s = None

    def step(self, batch: dict, precision_context) -> None:
        before = graphs_and_breaks()
        start_wall, start = time.perf_counter(), time.process_time()
        with precision_context():
            loss = pretraining_forward(self.module, batch)["loss"]
        loss.backward()
        seconds = time.process_time() - start
        getattr(self.module, "_orig_mod", self.module).zero_grad(set_to_none=True)
        after = graphs_and_breaks()
        self.graphs += after[0] - before[0]
        self.breaks += after[1] - before[1]
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - start_wall
        else:
            self.seconds.append(seconds)


def sides(model, backend: str) -> list[Side]:
    """Eager, compiled as training compiles, and (inductor) compiled with inductor's own RNG: other inductor options,
    so a graph of its own."""
    cpu = torch.device("cpu")
    if backend != "inductor":  # the smoke run: the graphs without inductor's (slow) code generation
        return [Side(EAGER, model), Side(COMPILED, torch.compile(model, backend=backend, dynamic=False))]
    return [Side(EAGER, model), Side(COMPILED, engine.compiled(model, "default", cpu)),
            Side(INDUCTOR_RNG, torch.compile(model, options={"fallback_random": False}, dynamic=False))]


def measure(name: str, path: str, args) -> tuple[list[Side], list[dict]]:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config, model = build(name, args.vocab, args.seq, args.size)
    batches = micro_batches(name, config, args)
    device = Device("cpu")
    measured = sides(model, args.backend)
    if path == "rows":
        path_context, precision = contextlib.nullcontext(), lambda: contextlib.nullcontext()
    else:
        path_context, precision = device.packed_path(), lambda: autocast(device.torch, "bf16")
    with path_context:
        for index, batch in enumerate(batches):
            for side in measured[index % len(measured):] + measured[:index % len(measured)]:
                side.step(batch, precision)
    return measured, batches


def report(name: str, path: str, measured: list[Side], batches: list[dict], backend: str) -> list[str]:
    """Print the family's table for one path; return its verdict lines."""
    real = sum(int((b["attention_mask"] > 0).sum()) for b in batches[1:])  # the first step compiles: not timed
    eager_ms = statistics.median(measured[0].seconds) * 1e3
    print(f"\n{name}, {path}: {len(batches)} micro-batches of {tuple(batches[0]['input_ids'].shape)} tokens, "
          f"{packings(batches)} packings, offsets of {len({len(b.get('cu_seqlens', ())) for b in batches})} lengths; "
          f"{measured[0].module.config.num_hidden_layers} layers")
    print("| side | step (median CPU ms) | vs eager | real tokens/s | graphs | graph breaks | first step s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for side in measured:
        ms = statistics.median(side.seconds) * 1e3
        print(f"| {side.name} | {ms:.1f} | {ms / eager_ms:.2f}x | {real / sum(side.seconds):,.0f} | {side.graphs} | "
              f"{side.breaks} | {side.first_step_s:.1f} |")
    compiled = measured[1]
    graphs = (f"{name} {path}: {compiled.graphs} graph, {compiled.breaks} breaks over {len(batches)} micro-batches "
              f"(goal 1 and 0): {'met' if (compiled.graphs, compiled.breaks) == (1, 0) else 'NOT met'}")
    ratio = statistics.median(compiled.seconds) * 1e3 / eager_ms
    if path != "rows":  # the GPU's graph on CPU: its attention is the custom ops' dense stand-in, on both sides
        return [graphs, f"{name} {path}: compiled step {ratio:.2f}x eager's (the GPU path's CPU stand-in: not judged)"]
    if backend != "inductor":  # aot_eager runs the traced graph without optimising it: its time says nothing
        return [graphs, f"{name} {path}: compiled step {ratio:.2f}x eager's (backend {backend}: not judged)"]
    verdict = "met" if ratio <= 1 else "NOT met"
    return [graphs, f"{name} {path}: compiled step {ratio:.2f}x eager's (goal <= 1): {verdict}"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="registry families, comma-separated")
    parser.add_argument("--paths", default=",".join(PATHS), help="rows, varlen (comma-separated)")
    parser.add_argument("--batches", type=int, default=100, help="micro-batches a side")
    parser.add_argument("--rows", type=int, default=8, help="rows a micro-batch")
    parser.add_argument("--seq", type=int, default=128, help="tokens a row")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (aot_eager: the smoke run)")
    parser.add_argument("--size", choices=sorted(PRESETS), default="cpu",
                        help="cpu: the tiny presets; real: the presets a GPU trains (bert-large, modernbert-base)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, backend {args.backend}, "
          f"{args.size} presets")
    verdicts = []
    for name in args.families.split(","):
        for path in args.paths.split(","):
            verdicts += report(name, path, *measure(name, path, args), args.backend)
    print("\n" + "\n".join(verdicts))


if __name__ == "__main__":
    main()
