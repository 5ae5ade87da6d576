# Stage 6: each text shard is WordPiece-tokenized once; both pretraining phases encode the same tokenized shards.


rule tokenize:
    input:
        shards="data/shards",
        vocab="data/vocab.txt",
    output:
        "data/tokenized/{split}/shard_{index}.npz",
    params:
        lowercase="--lowercase" if config["vocab"]["lowercase"] else "--no-lowercase",
    log:
        "logs/tokenize/{split}/shard_{index}.log",
    threads: 1
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.tokenize --text {input.shards}/{wildcards.split}/shard_{wildcards.index}.txt"
        " --vocab {input.vocab} --output {output}"
        " {params.lowercase} --threads {threads} 2> {log}"
