# Stage 3: one sentence per line (or one article per line), sentence-split with Punkt, offline.

# what the format rule reads for each source: extracted articles, or the downloaded books directory
FORMAT_INPUTS = {
    "wikipedia": "data/extracted/wikipedia.jsonl",
    "bookcorpus": "data/download/bookcorpus",
}


rule format:
    input:
        lookup(dpath="{source}", within=FORMAT_INPUTS),
    output:
        text="data/formatted/{source}.txt",
        summary="data/formatted/{source}.summary.json",  # read, kept, dropped by reason
    wildcard_constraints:
        source="wikipedia|bookcorpus",
    params:
        style=config["format"]["style"],
        min_article_chars=config["format"]["min_article_chars"],
        punkt_model=config["format"]["punkt_model"] or "",
    threads: 4
    log:
        "logs/format/{source}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.format --input {input:q} --output {output.text:q} --summary {output.summary:q} --style {params.style}"
        " --min-article-chars {params.min_article_chars} --punkt-model={params.punkt_model:q}"
        " --processes {threads} 2> {log}"
