# Your own tasks (config tasks, docs/tasks.md): classification, regression and token classification read CSV, TSV,
# JSONL or CoNLL, make their label list and features with the fine-tuned model's vocab and casing, fine-tune (GPU;
# GLUE's code for classification and regression), score the dev file and predict the test file. Question answering
# takes SQuAD-format files through the SQuAD code. The recipe is the glue section's (question answering: squad's),
# a task's own keys on top; fine-tuning starts where GLUE's (SQuAD's) does. Everything lands in results/tasks/<name>/.
from workflow.tasks.config import RECIPE_KEYS as TASK_RECIPE_KEYS, task_section


include: "functions/tasks.smk"


wildcard_constraints:
    task=names_pattern(task_names("classification", "regression", "token_classification")),
    qa_task=names_pattern(task_names("question_answering")),
    task_split="train|dev|test",


rule tasks:
    input:
        task_targets(),


rule task_labels:
    input:
        train=lambda wildcards: config["tasks"][wildcards.task]["train"],
    output:
        "data/tasks/{task}/labels.json",
    params:
        task=task_label_entry,
    log:
        "logs/task_labels/{task}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.tasks.data labels --task {params.task:q} --name {wildcards.task} --output {output:q}"
        " 2> {log}"


rule task_featurize:
    input:
        unpack(finetune_tokenizer("glue")),
        data=task_file,
        labels="data/tasks/{task}/labels.json",
        vocab=GLUE_VOCAB,
    output:
        "data/tasks/{task}/{task_split}_features.npz",
    params:
        task=task_entry,
        tokenizer=tokenizer_args,
        max_seq_length=task_max_seq_length,
    log:
        "logs/task_featurize/{task}/{task_split}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.tasks.data featurize --task {params.task:q} --name {wildcards.task}"
        " --split {wildcards.task_split} --labels {input.labels:q} --vocab {input.vocab:q} {params.tokenizer}"
        " --max-seq-length {params.max_seq_length} --output {output:q} 2> {log}"


rule task_finetune:
    input:
        model=GLUE_INIT,
        vocab=GLUE_VOCAB,
        labels="data/tasks/{task}/labels.json",
        features="data/tasks/{task}/train_features.npz",
    output:
        model=directory("results/tasks/{task}/model"),
        metrics="results/tasks/{task}/finetune_metrics.jsonl",
    params:
        recipe=task_recipe,
        config=config_sections("seed", "glue", "squad", "tasks"),
    threads: 8
    retries: 0  # not even the profile's: a scancel must stop it; the launcher requeues its own job
    resources:
        gpus=1,
    log:
        "logs/task_finetune/{task}.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.slurm.launch --run-dir runs/tasks/{wildcards.task} --"
        " python -m workflow.tasks.run finetune --config {params.config:q} --name {wildcards.task}"
        " --labels {input.labels:q} --init {input.model:q} --vocab {input.vocab:q} --features {input.features:q}"
        " --output {output.model:q} --metrics {output.metrics:q} --run-dir runs/tasks/{wildcards.task}"
        " --threads {threads} 2> {log}"


rule task_eval:
    input:
        model="results/tasks/{task}/model",
        labels="data/tasks/{task}/labels.json",
        features="data/tasks/{task}/dev_features.npz",
    output:
        report("results/tasks/{task}/eval.json", caption="../report/task_eval.rst", category="Tasks",
               subcategory="{task}"),
    params:
        config=config_sections("seed", "glue", "squad", "tasks"),
        batch_size=config["glue"]["eval_batch_size"],
        precision=config["glue"]["precision"],
    threads: 8
    resources:
        gpus=1,
    log:
        "logs/task_eval/{task}.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.tasks.run evaluate --config {params.config:q} --name {wildcards.task}"
        " --labels {input.labels:q} --model {input.model:q} --features {input.features:q} --output {output:q}"
        " --batch-size {params.batch_size} --precision {params.precision} --threads {threads} 2> {log}"


rule task_predict:
    input:
        model="results/tasks/{task}/model",
        labels="data/tasks/{task}/labels.json",
        features="data/tasks/{task}/test_features.npz",
    output:
        "results/tasks/{task}/predictions.jsonl",
    params:
        config=config_sections("seed", "glue", "squad", "tasks"),
        batch_size=config["glue"]["eval_batch_size"],
        precision=config["glue"]["precision"],
    threads: 8
    resources:
        gpus=1,
    log:
        "logs/task_predict/{task}.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.tasks.run predict --config {params.config:q} --name {wildcards.task}"
        " --labels {input.labels:q} --model {input.model:q} --features {input.features:q} --output {output:q}"
        " --batch-size {params.batch_size} --precision {params.precision} --threads {threads} 2> {log}"


# ---- Question answering: SQuAD-format train and dev files, through the SQuAD code (workflow/squad/)


rule qa_task_featurize:
    input:
        unpack(finetune_tokenizer("squad")),
        squad=qa_task_file,
        vocab=SQUAD_VOCAB,
    output:
        "data/tasks/{qa_task}/{squad_split}_features.npz",
    params:
        squad=qa_squad_section,
        tokenizer=tokenizer_args,
    log:
        "logs/qa_task_featurize/{qa_task}/{squad_split}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.squad.data --input {input.squad:q} --vocab {input.vocab:q} --output {output:q}"
        " --split {wildcards.squad_split} --version {params.squad[version]} {params.tokenizer}"
        " --max-seq-length {params.squad[max_seq_length]} --doc-stride {params.squad[doc_stride]}"
        " --max-query-length {params.squad[max_query_length]} 2> {log}"


rule qa_task_finetune:
    input:
        model=SQUAD_INIT,
        vocab=SQUAD_VOCAB,
        features="data/tasks/{qa_task}/train_features.npz",
    output:
        model=directory("results/tasks/{qa_task}/model"),
        metrics="results/tasks/{qa_task}/finetune_metrics.jsonl",
    params:
        recipe=qa_recipe,
        config=qa_finetune_config,
    threads: 8
    retries: 0  # not even the profile's: a scancel must stop it; the launcher requeues its own job
    resources:
        gpus=1,
    log:
        "logs/qa_task_finetune/{qa_task}.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.slurm.launch --run-dir runs/tasks/{wildcards.qa_task} --"
        " python -m workflow.squad.finetune --config {params.config:q}"
        " --init {input.model:q} --vocab {input.vocab:q} --features {input.features:q} --output {output.model:q}"
        " --metrics {output.metrics:q} --run-dir runs/tasks/{wildcards.qa_task} --threads {threads} 2> {log}"


rule qa_task_predict:
    input:
        model="results/tasks/{qa_task}/model",
        features="data/tasks/{qa_task}/dev_features.npz",
        squad=lambda wildcards: config["tasks"][wildcards.qa_task]["dev"],
    output:
        predictions="results/tasks/{qa_task}/predictions.json",
        nbest="results/tasks/{qa_task}/nbest_predictions.json",
    params:
        squad=qa_squad_section,
    threads: 8
    resources:
        gpus=1,
    log:
        "logs/qa_task_predict/{qa_task}.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.squad.predict --model {input.model:q} --features {input.features:q}"
        " --dataset {input.squad:q} --predictions {output.predictions:q} --nbest {output.nbest:q}"
        " --version {params.squad[version]} --n-best-size {params.squad[n_best_size]}"
        " --max-answer-length {params.squad[max_answer_length]}"
        " --null-score-diff-threshold {params.squad[null_score_diff_threshold]} --precision {params.squad[precision]}"
        " --threads {threads} 2> {log}"


rule qa_task_eval:
    input:
        squad=lambda wildcards: config["tasks"][wildcards.qa_task]["dev"],
        predictions="results/tasks/{qa_task}/predictions.json",
    output:
        report("results/tasks/{qa_task}/eval.json", caption="../report/task_eval.rst", category="Tasks",
               subcategory="{qa_task}"),
    params:
        version=config["squad"]["version"],
    log:
        "logs/qa_task_eval/{qa_task}.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m workflow.squad.evaluate --dataset {input.squad:q} --predictions {input.predictions:q}"
        " --version {params.version} --output {output:q} 2> {log}"
