# Stages 7-8: masked-LM + next-sentence instances per tokenized shard (packed; NVIDIA's HDF5 schema with
# encode.packing.enabled false), then the directory a trainer reads, data/hdf5_seq{seq}: both splits hard-linked
# from data/encoded_seq{seq} + manifest.json.


include: "functions/encode.smk"


rule encode:
    input:
        tokenized="data/tokenized/{split}/shard_{index}.npz",
        vocab=VOCAB,
    output:
        "data/encoded_seq{seq}/{split}/shard_{index}.hdf5",
    params:
        max_predictions_per_seq=max_predictions_per_seq,
        dupe_factor=config["encode"]["dupe_factor"],
        masked_lm_prob=config["encode"]["masked_lm_prob"],
        short_seq_prob=config["encode"]["short_seq_prob"],
        masking=masking_arguments,
        compression=config["encode"]["compression"],
        packing=packing_arguments,
        seed=config["seed"],
    log:
        "logs/encode/seq{seq}/{split}/shard_{index}.log",
    threads: 1
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.encode --tokenized {input.tokenized} --vocab {input.vocab} --output {output}"
        " --max-seq-length {wildcards.seq} --max-predictions-per-seq {params.max_predictions_per_seq}"
        " --dupe-factor {params.dupe_factor} --masked-lm-prob {params.masked_lm_prob}"
        " --short-seq-prob {params.short_seq_prob} {params.masking} --compression {params.compression}"
        " {params.packing}"
        " --seed {params.seed} --split {wildcards.split} --shard-index {wildcards.index} 2> {log}"


rule hdf5_dir:
    input:
        encoded_shards,
    output:
        directory("data/hdf5_seq{seq}"),
    params:
        n_training_shards=config["shard"]["n_training_shards"],
        n_test_shards=config["shard"]["n_test_shards"],
    log:
        "logs/hdf5_dir/seq{seq}.log",
    threads: 16  # sha256 of the shards (~48 GB per length at full size), one file per thread
    conda:
        "../envs/data.yaml"
    shell:
        # The encoded directory, not {input}: thousands of paths would overflow one shell argument.
        "python -m workflow.data.hdf5_dir --encoded data/encoded_seq{wildcards.seq}"
        " --n-training-shards {params.n_training_shards} --n-test-shards {params.n_test_shards}"
        " --threads {threads} --output {output} 2> {log}"
