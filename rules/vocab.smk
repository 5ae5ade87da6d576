# Stage 5: the WordPiece vocab every later stage reads. data/vocab.txt is the frozen artifact: the tokenizers
# trainer is not deterministic across runs, so it is trained once and kept.


if config["vocab"]["file"]:

    rule vocab:
        input:
            config["vocab"]["file"],
        output:
            "data/vocab.txt",
        log:
            "logs/vocab/vocab.log",
        conda:
            "../envs/data.yaml"
        shell:
            "python -m workflow.data.vocab --vocab-file {input:q} --output {output} 2> {log}"

else:

    rule vocab:
        input:
            "data/shards",
        output:
            "data/vocab.txt",
        params:
            size=config["vocab"]["size"],
            lowercase="--lowercase" if config["vocab"]["lowercase"] else "--no-lowercase",
            n_shards=len(vocab_shard_indices()),
        log:
            "logs/vocab/vocab.log",
        conda:
            "../envs/data.yaml"
        shell:
            # The shard directory, not {input}: thousands of paths would overflow one shell argument.
            "python -m workflow.data.vocab --shard-dir data/shards/training --n-shards {params.n_shards}"
            " --size {params.size} {params.lowercase} --output {output} 2> {log}"
