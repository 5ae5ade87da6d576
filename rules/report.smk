# The run's summary table and the report figures (`snakemake --report report.html` collects everything marked
# with report()). GPU telemetry is read from the phase directories when pretraining recorded it.
import json


# `--phase phase1=results/pretrain/phase1 --phase phase2=...` for the summary and plot commands.
PRETRAIN_PHASE_ARGS = " ".join(f"--phase {phase}=results/pretrain/{phase}" for phase in PHASES)
PRETRAIN_METRICS = expand("results/pretrain/{phase}/{name}", phase=PHASES, name=["metrics.jsonl", "summary.json"])


rule summary:
    input:
        pretrain=PRETRAIN_METRICS,
        squad=list(summary_squad_inputs().values()),
        glue_evals=glue_targets(),
        task_evals=expand("results/tasks/{name}/eval.json", name=list(config["tasks"])),
    output:
        report("results/summary.csv", caption="../report/summary.rst", category="Summary"),
    params:
        phases=PRETRAIN_PHASE_ARGS,
        squad=" ".join(f"--{key.replace('_', '-')} {path}" for key, path in summary_squad_inputs().items()),
        glue=" ".join(f"--glue-eval {path}" for path in glue_targets()),
        tasks=" ".join(f"--task-eval results/tasks/{name}/eval.json" for name in config["tasks"]),
        target=config["pretrain"]["target_mlm_accuracy"],
    log:
        "logs/summary/summary.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m workflow.report.summary {params.phases} {params.squad} {params.glue} {params.tasks}"
        " --target-mlm-accuracy {params.target} --output {output:q} 2> {log}"


rule report_pretrain_plots:
    input:
        PRETRAIN_METRICS,
    output:
        loss=report("results/report/pretrain_loss.png", caption="../report/pretrain_loss.rst", category="Pretraining"),
        accuracy=report("results/report/mlm_accuracy.png", caption="../report/mlm_accuracy.rst", category="Pretraining"),
        throughput=report("results/report/throughput.png", caption="../report/throughput.rst", category="Pretraining"),
    params:
        phases=PRETRAIN_PHASE_ARGS,
    log:
        "logs/report_pretrain_plots/plots.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m workflow.report.report pretrain {params.phases} --loss {output.loss:q}"
        " --accuracy {output.accuracy:q} --throughput {output.throughput:q} 2> {log}"


rule report_heldout_accuracy:
    input:
        PRETRAIN_METRICS,
    output:
        report("results/report/heldout_accuracy.png", caption="../report/heldout_accuracy.rst", category="Pretraining"),
    params:
        phases=PRETRAIN_PHASE_ARGS,
        target=config["pretrain"]["target_mlm_accuracy"],
    log:
        "logs/report_heldout_accuracy/plot.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m workflow.report.report heldout {params.phases} --target {params.target} --output {output:q} 2> {log}"


rule report_gpu_telemetry:
    input:
        PRETRAIN_METRICS,
    output:
        report("results/report/gpu_telemetry.png", caption="../report/gpu_telemetry.rst", category="Pretraining"),
    params:
        phases=PRETRAIN_PHASE_ARGS,
    log:
        "logs/report_gpu_telemetry/telemetry.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m workflow.report.report telemetry {params.phases} --output {output:q} 2> {log}"


rule report_squad_plot:
    input:
        metrics="results/squad/finetune_metrics.jsonl",
        squad_eval="results/squad/eval.json",
    output:
        report("results/report/squad_finetune.png", caption="../report/squad_finetune.rst", category="SQuAD"),
    log:
        "logs/report_squad_plot/plot.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m workflow.report.report squad --metrics {input.metrics:q} --eval {input.squad_eval:q}"
        " --output {output:q} 2> {log}"


rule report_config:
    output:
        report("results/report/config.yaml", caption="../report/config.rst", category="Configuration"),
    params:
        # Rerun when any config value changes (params are a rerun trigger).
        config=json.dumps(config, sort_keys=True),
    log:
        "logs/report_config/config.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m workflow.report.report config --json {params.config:q} --output {output:q} 2> {log}"
