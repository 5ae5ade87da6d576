# A few-minute check of a new cluster, with the phase-1 job's launcher, its real trainer on the configured phase-1
# data, and a 2-node all-GPU layout (the profile's set-resources cluster_check): world size, rank -> host/GPU/cores,
# all-reduce bus bandwidth, seq/s, one checkpoint write, packed vs unpacked loss, and first each fast path of each
# rank against its reference (docs/gpu.md). Not part of `all`:
# `snakemake --profile slurm cluster_check`: needs only the phase-1 data and the vocab (built first if missing;
# docs/cluster.md, "A new cluster"), or with `cluster_check.data: synthetic` nothing of the data half.


include: "functions/cluster_check.smk"


rule cluster_check_synthetic_data:
    input:
        given_vocab,
    output:
        data=directory(f"{SYNTHETIC_CHECK_DATA}/hdf5"),
        vocab=f"{SYNTHETIC_CHECK_DATA}/vocab.txt",
    params:
        # plain JSON, not config_sections: a change of these sections makes other data, so it reruns (seconds)
        config=json.dumps({key: config[key] for key in ("seed", "vocab", "encode")}, sort_keys=True),
    log:
        "logs/cluster_check/synthetic_data.log",
    threads: 1
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.synthetic_shards --config {params.config:q} --output-data {output.data}"
        " --output-vocab {output.vocab} 2> {log}"


rule cluster_check:
    input:
        unpack(cluster_check_data),
    output:
        "results/cluster_check.json",
    log:
        "logs/cluster_check/cluster_check.log",
    params:
        config=config_sections("seed", "model", "pretrain"),
    threads: 8
    resources:
        gpus=1,
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.slurm.launch --run-dir runs/cluster_check --"
        " python -m workflow.slurm.cluster_check --config {params.config:q} --data-dir {input.data}"
        " --vocab {input.vocab} --run-dir runs/cluster_check --output {output} --threads {threads} 2> {log}"
