# Input and params functions of rules/format.smk (functions apart from rules, as `snakemake --lint` asks).


def punkt_training_parts(wildcards):
    """The parts of the dump Punkt trains on (their first pages, extracted by punkt itself): the first
    format.punkt_parts (null: all), in page-id order."""
    return wikipedia_parts("data/download/wikipedia/{part}.xml.bz2")[: config["format"]["punkt_parts"]]


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
