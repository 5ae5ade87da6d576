# SQuAD: download train/dev JSON, featurize with the model's WordPiece vocab and casing, fine-tune (GPU), predict,
# evaluate. Fine-tuning starts from the phase-2 export unless config squad.init_from names another HF BERT directory
# or an NVIDIA DLE checkpoint (then `snakemake squad` plans no pretraining at all); it reads the config sections seed
# and squad whole (params.config, not part of the rerun check); params.recipe holds only what changes the model.


include: "functions/squad.smk"


# The HF BERT directory fine-tuning starts from, and its vocab (data/vocab.txt for our own pretraining).
SQUAD_INIT = finetune_init("squad")
SQUAD_VOCAB = finetune_vocab("squad")


wildcard_constraints:
    squad_split="train|dev",


rule squad:
    input:
        "results/squad/eval.json",


rule squad_download_train:
    output:
        "data/download/squad/train.json",
    params:
        url=config["squad"]["train_url"],
    log:
        "logs/squad_download/train.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.download file --url {params.url:q} --output {output:q} 2> {log}"


rule squad_download_dev:
    output:
        "data/download/squad/dev.json",
    params:
        url=config["squad"]["dev_url"],
    log:
        "logs/squad_download/dev.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.download file --url {params.url:q} --output {output:q} 2> {log}"


rule squad_featurize:
    input:
        unpack(finetune_tokenizer("squad")),
        squad="data/download/squad/{squad_split}.json",
        vocab=SQUAD_VOCAB,
    output:
        "data/squad/{squad_split}_features.npz",
    params:
        version=config["squad"]["version"],
        tokenizer=tokenizer_args,
        max_seq_length=config["squad"]["max_seq_length"],
        doc_stride=config["squad"]["doc_stride"],
        max_query_length=config["squad"]["max_query_length"],
    log:
        "logs/squad_featurize/{squad_split}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.squad.data --input {input.squad:q} --vocab {input.vocab:q} --output {output:q}"
        " --split {wildcards.squad_split} --version {params.version} {params.tokenizer}"
        " --max-seq-length {params.max_seq_length} --doc-stride {params.doc_stride}"
        " --max-query-length {params.max_query_length} 2> {log}"


rule squad_finetune:
    input:
        model=SQUAD_INIT,
        vocab=SQUAD_VOCAB,
        features="data/squad/train_features.npz",
    output:
        model=directory("results/squad/model"),
        metrics="results/squad/finetune_metrics.jsonl",
    params:
        recipe=squad_recipe,
        config=config_sections("seed", "squad"),
    threads: 8
    retries: 0  # not even the profile's: a scancel must stop it; the launcher requeues its own job
    resources:
        gpus=1,
    log:
        "logs/squad_finetune/finetune.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.slurm.launch --run-dir runs/squad --"
        " python -m workflow.squad.finetune --config {params.config:q}"
        " --init {input.model:q} --vocab {input.vocab:q} --features {input.features:q}"
        " --output {output.model:q} --metrics {output.metrics:q} --run-dir runs/squad --threads {threads} 2> {log}"


rule squad_predict:
    input:
        model="results/squad/model",
        features="data/squad/dev_features.npz",
        squad="data/download/squad/dev.json",
    output:
        predictions="results/squad/predictions.json",
        nbest="results/squad/nbest_predictions.json",
    params:
        version=config["squad"]["version"],
        n_best_size=config["squad"]["n_best_size"],
        max_answer_length=config["squad"]["max_answer_length"],
        null_score_diff_threshold=config["squad"]["null_score_diff_threshold"],
        precision=config["squad"]["precision"],
    threads: 8
    resources:
        gpus=1,
    log:
        "logs/squad_predict/predict.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.squad.predict --model {input.model:q} --features {input.features:q}"
        " --dataset {input.squad:q} --predictions {output.predictions:q} --nbest {output.nbest:q}"
        " --version {params.version}"
        " --n-best-size {params.n_best_size} --max-answer-length {params.max_answer_length}"
        " --null-score-diff-threshold {params.null_score_diff_threshold} --precision {params.precision}"
        " --threads {threads}"
        " 2> {log}"


rule squad_eval:
    input:
        squad="data/download/squad/dev.json",
        predictions="results/squad/predictions.json",
    output:
        report("results/squad/eval.json", caption="../report/squad_eval.rst", category="SQuAD"),
    params:
        version=config["squad"]["version"],
    log:
        "logs/squad_eval/eval.log",
    conda:
        "../envs/report.yaml"
    shell:
        "python -m workflow.squad.evaluate --dataset {input.squad:q} --predictions {input.predictions:q}"
        " --version {params.version} --output {output:q} 2> {log}"
