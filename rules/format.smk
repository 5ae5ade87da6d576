# Stage 3: one sentence per line (or one article per line), sentence-split with Punkt, offline; one job per part of
# the Wikipedia dump. Unless format.punkt_model is set, Punkt is trained once on the corpus' first characters (the
# first format.punkt_parts parts, in order), so a part's format waits for its own extract and punkt, no other.


include: "functions/format.smk"


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
