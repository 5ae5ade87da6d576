# snakebert: raw Wikipedia (+ optional BookCorpus) -> pretrained BERT -> SQuAD and GLUE scores.
# The table of contents of the workflow; every stage lives in rules/<stage>.smk.
import os

from snakemake.utils import min_version

min_version("9.0")


# The run directory's config.yaml where it has one (`--directory DIR`), else the workflow's (the schema's defaults)
configfile: "config.yaml" if os.path.exists("config.yaml") else f"{workflow.basedir}/config.yaml"


include: "rules/common.smk"
include: "rules/download.smk"
include: "rules/extract.smk"
include: "rules/format.smk"
include: "rules/shard.smk"
include: "rules/vocab.smk"
include: "rules/tokenize.smk"
include: "rules/encode.smk"
include: "rules/clean.smk"
include: "rules/pretrain.smk"
include: "rules/squad.smk"
include: "rules/glue.smk"
include: "rules/tasks.smk"
include: "rules/report.smk"
include: "rules/cluster_check.smk"
include: "rules/scaling.smk"


# Seconds of work each: run by Snakemake itself on the submit host, not through sbatch.
localrules:
    all,
    wikipedia_dump_date,
    summary,
    report_pretrain_plots,
    report_gpu_telemetry,
    report_squad_plot,
    report_config,
    squad_eval,
    scaling,
    scaling_table,
    report_scaling_plot,
    clean_intermediates,
    corpus_statistics,


rule all:
    input:
        all_targets(),
    default_target: True


# The data, both pretraining phases and the pretraining part of the report; no fine-tuning.
rule pretrain:
    input:
        pretrain_targets(),
