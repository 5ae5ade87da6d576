# A few-minute check of a new cluster, with the phase-1 job's launcher and a 2-node all-GPU layout (the profile's
# set-resources cluster_check): world size, rank -> host/GPU/cores, all-reduce bus bandwidth, seq/s on random
# phase-1 batches. Not part of `all`: `snakemake --profile slurm cluster_check` (README, "A new cluster").


rule cluster_check:
    output:
        "results/cluster_check.json",
    log:
        "logs/cluster_check/cluster_check.log",
    params:
        preset=config["model"]["preset"],
        micro_batch_size=config["pretrain"]["phase1"]["micro_batch_size"],
        precision=config["pretrain"]["precision"],
    threads: 8
    resources:
        gpus=1,
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.slurm.launch -- python -m workflow.slurm.cluster_check --output {output}"
        " --preset {params.preset} --micro-batch-size {params.micro_batch_size} --precision {params.precision}"
        " 2> {log}"
