"""benchmarks/projection_check.py: the dump it generates is read by the workflow as a dump in parts, and the job
times it compares with the model's come from a real Snakemake log, each job under its stage."""
import bz2
import hashlib
import re
import subprocess
import sys

from benchmarks.enwiki_pages import template_set
from benchmarks.projection_check import parse_log, stage_of, write_dump
from workflow.data.download import dump_parts, fetch_dump


def test_the_generated_dump_in_parts_is_listed_split_and_verified_as_wikimedias(tmp_path):
    generated = write_dump(tmp_path / "dump", 3, 3)
    parts = dump_parts(generated["url"], None, "auto", tmp_path / "cache")
    assert [part.name for part in parts] == [f"p{p['first_id']}p{p['last_id']}" for p in generated["parts"]]
    firsts = [p["first_id"] for p in generated["parts"]]
    assert firsts == sorted(firsts) and all(p["last_id"] < q["first_id"] for p, q in zip(generated["parts"],
                                                                                            generated["parts"][1:]))
    text = ""
    for part in parts:  # the download verifies each part against its md5 in the list beside the dump
        text += bz2.decompress(fetch_dump(part.url, tmp_path / f"{part.name}.xml.bz2").read_bytes()).decode()
    # the template set spread over the parts: each template page in exactly one part, none lost
    titles = re.findall(r"<title>(Template:[^<]*)</title>", text)
    expected = re.findall(r"<title>([^<]*)</title>", "".join(template_set(generated["templates"])))
    assert sorted(titles) == sorted(expected) and len(set(titles)) == len(titles)
    ids = re.findall(r"<page>\s*<title>[^<]*</title>\s*<ns>0</ns>\s*<id>(\d+)</id>", text)
    assert len(ids) == len(set(ids)) == sum(p["articles"] + p["redirects"] for p in generated["parts"])
    listing = (tmp_path / "dump" / "enwiki-20240601-md5sums.txt").read_text().splitlines()
    assert len(listing) == 3 and all(
        line.split()[0] == hashlib.md5((tmp_path / "dump" / line.split()[1]).read_bytes()).hexdigest()
        for line in listing)


SNAKEFILE = """
rule all:
    input: expand("encoded_seq{seq}/shard_{index}.txt", seq=[128, 512], index=[0])
rule encode:
    output: "encoded_seq{seq}/shard_{index}.txt"
    shell: "sleep 1; touch {output}"
"""


def test_each_job_of_a_real_snakemake_log_gives_its_stage_and_its_times(tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "1"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    jobs = parse_log(result.stderr)
    encodes = sorted((stage_of(job), job["end"] - job["start"]) for job in jobs if job["rule"] == "encode")
    # one core: one job at a time, each of a whole second at least (the log's times are whole seconds)
    assert [stage for stage, _ in encodes] == ["encode 128", "encode 512"]
    assert all(1 <= seconds <= 3 for _, seconds in encodes)
    runs = sorted((job["start"], job["end"]) for job in jobs if job["rule"] == "encode")
    assert runs[0][1] <= runs[1][0]
    assert [stage_of(job) for job in jobs if job["rule"] == "all"] == [None]
    assert stage_of({"rule": "extract_wikipedia", "wildcards": "part=p1p9"}) == "extract"
