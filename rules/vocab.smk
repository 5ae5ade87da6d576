# Stage 5: the vocab every later stage reads (VOCAB: a WordPiece vocab.txt or, vocab.type bpe, a byte-level BPE
# tokenizer.json): a given vocab.file checked and copied, or one trained on the first vocab.training_shards training
# shards (default 8 of 256: ~0.5 GB of full enwiki text), the same file for the same shards whatever the threads
# (workflow/data/vocab.py fixes the alphabet and the `##x` numbering).


include: "functions/vocab.smk"


if config["vocab"]["file"]:

    localrules:
        vocab,  # a copy: no Slurm job, so no wait for the plugin's next status check before tokenize

    rule vocab:
        input:
            config["vocab"]["file"],
        output:
            VOCAB,
        log:
            "logs/vocab/vocab.log",
        conda:
            "../envs/data.yaml"
        shell:
            f"python -m workflow.data.vocab{VOCAB_TYPE_FLAG} --vocab-file {{input:q}} --output {{output}} 2> {{log}}"

else:

    rule vocab:
        input:
            "data/shards",
        output:
            VOCAB,
        params:
            size=config["vocab"]["size"],
            normalization=normalization_flags(),
            n_shards=len(vocab_shard_indices()),
        log:
            "logs/vocab/vocab.log",
        threads: 16  # the trainer's word counting scales with threads; every later stage waits for it
        conda:
            "../envs/data.yaml"
        shell:
            # The shard directory, not {input}: thousands of paths would overflow one shell argument.
            f"python -m workflow.data.vocab{VOCAB_TYPE_FLAG} --shard-dir data/shards/training"
            " --n-shards {params.n_shards}"
            " --size {params.size} {params.normalization} --threads {threads} --output {output} 2> {log}"
