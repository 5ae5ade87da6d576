# Stage 6: each text shard is tokenized once (WordPiece or BPE, as VOCAB); both pretraining phases encode the same tokenized shards.


include: "functions/tokenize.smk"


rule tokenize:
    input:
        shards="data/shards",
        vocab=VOCAB,
    output:
        "data/tokenized/{split}/shard_{index}.npz",
    params:
        normalization=normalization_flags(),
    log:
        "logs/tokenize/{split}/shard_{index}.log",
    threads: 1
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.tokenize --text {input.shards}/{wildcards.split}/shard_{wildcards.index}.txt"
        " --vocab {input.vocab} --output {output}"
        " {params.normalization} --threads {threads} 2> {log}"


# Per corpus, what reached the pretraining data: documents and sentences (format) and tokens (tokenize).
rule corpus_statistics:
    input:
        unpack(corpus_statistics_inputs),
    output:
        report("results/corpora.csv", caption="../report/corpora.rst", category="Data"),
    log:
        "logs/corpus_statistics/corpora.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.report.corpora --formatted {input.formatted:q} --manifest {input.shards}/corpora.json"
        " --tokenized data/tokenized --output {output:q} 2> {log}"
