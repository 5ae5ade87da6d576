"""Regenerate the demo's GLUE sample: `python sample/glue/make_glue_sample.py`.

Two tasks of our own writing, laid out as the GLUE distribution (download_glue_data.py) lays them out, small and
learnable: SST-2 (sentence, label; the label follows the review's cue word: great/awful ...) and MRPC (quality, ids,
two sentences; a paraphrase says the same thing about the same place, a non-paraphrase names another place).
"""
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBJECTS = "the film|the movie|this story|the plot|the acting|the music|the ending|the cast|the script|the show".split("|")
POSITIVE = "great wonderful brilliant moving delightful superb charming excellent".split()
NEGATIVE = "awful boring dull terrible clumsy tedious weak dreadful".split()
FILLER = ["", "really ", "quite ", "at times ", "mostly ", "simply "]
PEOPLE = "the mayor|the teacher|a doctor|the team|the minister|a farmer|the company|the band".split("|")
PLACES = "paris london berlin madrid rome vienna lisbon dublin oslo prague".split()
VERBS = [("visited", "went to"), ("opened an office in", "set up an office in"), ("moved to", "relocated to"),
         ("played in", "performed in")]


def sst2_rows(n: int, rng: random.Random) -> list[str]:
    rows = []
    for _ in range(n):
        label = rng.randint(0, 1)
        word = rng.choice(POSITIVE if label else NEGATIVE)
        rows.append(f"{rng.choice(SUBJECTS)} is {rng.choice(FILLER)}{word} \t{label}")
    return rows


def mrpc_rows(n: int, rng: random.Random, first_id: int) -> list[str]:
    rows = []
    for i in range(n):
        person, place, (verb, paraphrase) = rng.choice(PEOPLE), rng.choice(PLACES), rng.choice(VERBS)
        label = rng.randint(0, 1)
        other = place if label else rng.choice([p for p in PLACES if p != place])
        a = f"{person} {verb} {place} last year ."
        b = f"last year {person} {paraphrase} {other} ."
        rows.append(f"{label}\t{first_id + 2 * i}\t{first_id + 2 * i + 1}\t{a}\t{b}")
    return rows


def main() -> None:
    rng = random.Random(20261121)
    for name, header, make in (("SST-2", "sentence\tlabel", lambda n, r, start: sst2_rows(n, r)),
                               ("MRPC", "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String", mrpc_rows)):
        (HERE / name).mkdir(exist_ok=True)
        for split, n, start in (("train", 240, 1000), ("dev", 80, 5000)):
            rows = make(n, rng, start)
            (HERE / name / f"{split}.tsv").write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
