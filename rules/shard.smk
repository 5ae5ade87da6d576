# Stage 4: balanced, deterministic training/test text shards (one sentence per line, blank line between documents).


include: "functions/shard.smk"


# Streams over every formatted part in corpus order, so the shards do not depend on the parts' order of completion.


rule shard:
    input:
        formatted_corpora,
    output:
        # one directory, not thousands of files: Snakemake's DAG cost grows with outputs per job x consumers
        directory("data/shards"),
    params:
        n_training_shards=config["shard"]["n_training_shards"],
        n_test_shards=config["shard"]["n_test_shards"],
        test_fraction=config["shard"]["test_fraction"],
        seed=config["seed"],
        style=config["format"]["style"],
        punkt_model=config["format"]["punkt_model"] or "",
    log:
        "logs/shard/shard.log",
    threads: 16  # both passes run over the parts in parallel (pass 2 writes each part's stretch of every shard)
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.shard --input {input:q} --input-style {params.style}"
        " --punkt-model={params.punkt_model:q}"
        " --output-dir {output:q}"
        " --n-training-shards {params.n_training_shards} --n-test-shards {params.n_test_shards}"
        " --test-fraction {params.test_fraction} --seed {params.seed} --processes {threads} 2> {log}"
