# Stage 3: one sentence per line (or one article per line), sentence-split with Punkt, offline; one job per part of
# the Wikipedia dump. Unless format.punkt_model is set, Punkt is trained once on the corpus' first characters (the
# first format.punkt_parts parts, in order), so a part's format waits for its own extract and punkt, no other.


def punkt_training_parts(wildcards):
    """The extracted parts Punkt trains on: the first format.punkt_parts (null: all), in page-id order."""
    return wikipedia_parts("data/extracted/wikipedia/{part}.jsonl")[: config["format"]["punkt_parts"]]


def format_inputs(wildcards):
    """What format reads: a part's extracted articles and the corpus' Punkt model, or the books directory."""
    if wildcards.corpus == "bookcorpus":
        return {"text": "data/download/bookcorpus"}
    inputs = {"text": f"data/extracted/{wildcards.corpus}.jsonl"}
    if not config["format"]["punkt_model"]:
        inputs["punkt"] = "data/punkt/wikipedia"
    return inputs


def format_punkt_model(wildcards):
    """The Punkt model format loads: the configured one, else (Wikipedia) the one trained once, else none
    (books: format trains on them)."""
    if config["format"]["punkt_model"] or wildcards.corpus == "bookcorpus":
        return config["format"]["punkt_model"] or ""
    return "data/punkt/wikipedia"


rule punkt:
    input:
        punkt_training_parts,
    output:
        directory("data/punkt/wikipedia"),
    log:
        "logs/punkt/wikipedia.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.punkt --input {input:q} --output {output:q} 2> {log}"


rule format:
    input:
        unpack(format_inputs),
    output:
        text="data/formatted/{corpus}.txt",
        summary="data/formatted/{corpus}.summary.json",  # read, kept, dropped by reason
    wildcard_constraints:
        corpus=r"bookcorpus|wikipedia/(whole|p\d+p\d+)",
    params:
        style=config["format"]["style"],
        min_article_chars=config["format"]["min_article_chars"],
        punkt_model=format_punkt_model,
    threads: 4
    log:
        "logs/format/{corpus}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.format --input {input.text:q} --output {output.text:q} --summary {output.summary:q}"
        " --style {params.style}"
        " --min-article-chars {params.min_article_chars} --punkt-model={params.punkt_model:q}"
        " --processes {threads} 2> {log}"
