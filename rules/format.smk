# Stage 3: one sentence per line (or one article per line), sentence-split with Punkt, offline; one job per part of
# the Wikipedia dump, one for BookCorpus, one per entry of `corpora` (Punkt trained on each of these itself). Unless format.punkt_model is set, Punkt is trained once on the corpus' first characters (the
# first pages of the first format.punkt_parts parts, which punkt extracts itself with the compiled templates), so a
# part's format waits for its own extract and punkt, and punkt for no extract: it runs beside the extracts.


include: "functions/format.smk"


rule punkt:
    input:
        dumps=punkt_training_parts,
        templates="data/extracted/wikipedia/templates.bin",
    output:
        directory("data/punkt/wikipedia"),
    threads: 16  # wikiextractor's processes on the first pages (256 MB of XML at enwiki's size); the training is serial
    log:
        "logs/punkt/wikipedia.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.punkt --dump {input.dumps:q} --templates {input.templates:q}"
        " --processes {threads} --output {output:q} 2> {log}"


rule format:
    input:
        unpack(format_inputs),
    output:
        text="data/formatted/{corpus}.txt",
        summary="data/formatted/{corpus}.summary.json",  # read, kept, dropped by reason
    wildcard_constraints:
        corpus=r"bookcorpus|wikipedia/(whole|p\d+p\d+)|corpora/[A-Za-z0-9_-]+",
    params:
        source=format_source,
        language=format_language,
        style=config["format"]["style"],
        min_article_chars=config["format"]["min_article_chars"],
        punkt_model=format_punkt_model,
    threads: 4
    log:
        "logs/format/{corpus}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.format {params.source} --output {output.text:q} --summary {output.summary:q}"
        " --style {params.style} --language {params.language}"
        " --min-article-chars {params.min_article_chars} --punkt-model={params.punkt_model:q}"
        " --processes {threads} 2> {log}"
