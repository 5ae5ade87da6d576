# The scaling study (`snakemake scaling`, not part of `all`): one fixed-iteration pretraining benchmark job per
# configured layout and phase, submitted through the same profile and launcher as the phases. A layout `NxG` is one
# Slurm allocation of N nodes with G GPUs each (resources below; the profile's set-resources for scaling_benchmark
# add partition, tasks_per_gpu, CPUs, memory and time, never nodes or gres). Each job trains in its own scratch
# directory runs/scaling/{phase}/{layout} (emptied before, removed after: never a phase's checkpoints) and writes its
# measurements; the table adds speedup and efficiency against the smallest layout. Threads: two CPU threads per rank
# in every layout (as a phase job's 8 threads on 4 GPUs), so that layouts differ only in their number of ranks.


include: "functions/scaling.smk"


rule scaling:
    input:
        "results/scaling/scaling.csv",
        "results/report/scaling.png",


rule scaling_benchmark:
    input:
        data=scaling_data,
        vocab=VOCAB,
    output:
        "results/scaling/{phase}/{layout}.json",
    params:
        config=config_sections("seed", "model", "pretrain", "scaling"),
    log:
        "logs/scaling/{phase}/{layout}.log",
    threads: scaling_threads
    resources:
        nodes=scaling_nodes,
        gres=scaling_gres,
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.slurm.launch -- python -m workflow.train.scaling benchmark --phase {wildcards.phase}"
        " --layout {wildcards.layout} --config {params.config:q} --data-dir {input.data} --vocab {input.vocab}"
        " --run-dir runs/scaling/{wildcards.phase}/{wildcards.layout} --output {output} --threads {threads} 2> {log}"


rule scaling_table:
    input:
        scaling_results(),
    output:
        report("results/scaling/scaling.csv", caption="../report/scaling_table.rst", category="Scaling"),
    log:
        "logs/scaling/table.log",
    conda:
        "../envs/train.yaml"  # workflow.train.scaling imports the trainer
    shell:
        "python -m workflow.train.scaling table {input:q} --output {output:q} 2> {log}"


rule report_scaling_plot:
    input:
        "results/scaling/scaling.csv",
    output:
        report("results/report/scaling.png", caption="../report/scaling.rst", category="Scaling"),
    log:
        "logs/report_scaling_plot/plot.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m workflow.report.report scaling --table {input:q} --output {output:q} 2> {log}"
