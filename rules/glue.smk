# GLUE: download each configured task's TSV files, featurize them with the model's WordPiece vocab, fine-tune (GPU),
# score the dev set(s). Fine-tuning starts from the phase-2 export unless config glue.init_from names another HF BERT
# directory or an NVIDIA DLE checkpoint (then `snakemake glue` plans no pretraining at all); it reads the config
# sections seed and glue whole (params.config, not part of the rerun check); params.recipe holds only what changes
# the task's model. Features take the fine-tuned model's vocab and casing.


include: "functions/glue.smk"


GLUE_INIT = finetune_init("glue")
GLUE_VOCAB = finetune_vocab("glue")


wildcard_constraints:
    glue_task="CoLA|SST-2|MRPC|STS-B|QQP|MNLI|QNLI|RTE|WNLI",
    glue_file="train|dev|dev_matched|dev_mismatched",


rule glue:
    input:
        glue_targets(),


rule glue_download:
    output:
        "data/download/glue/{glue_task}/{glue_file}.tsv",
    params:
        url=glue_file_url,
    log:
        "logs/glue_download/{glue_task}/{glue_file}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.download file --url {params.url:q} --output {output:q} 2> {log}"


rule glue_featurize:
    input:
        unpack(finetune_tokenizer("glue")),
        tsv="data/download/glue/{glue_task}/{glue_file}.tsv",
        vocab=GLUE_VOCAB,
    output:
        "data/glue/{glue_task}/{glue_file}_features.npz",
    params:
        tokenizer=tokenizer_args,
        max_seq_length=glue_max_seq_length,
    log:
        "logs/glue_featurize/{glue_task}/{glue_file}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.glue.data --task {wildcards.glue_task} --input {input.tsv:q} --vocab {input.vocab:q}"
        " --output {output:q} {params.tokenizer} --max-seq-length {params.max_seq_length} 2> {log}"


rule glue_finetune:
    input:
        model=GLUE_INIT,
        vocab=GLUE_VOCAB,
        features="data/glue/{glue_task}/train_features.npz",
    output:
        model=directory("results/glue/{glue_task}/model"),
        metrics="results/glue/{glue_task}/finetune_metrics.jsonl",
    params:
        recipe=glue_recipe,
        config=config_sections("seed", "glue"),
    threads: 8
    retries: 0  # not even the profile's: a scancel must stop it; the launcher requeues its own job
    resources:
        gpus=1,
    log:
        "logs/glue_finetune/{glue_task}.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.slurm.launch --run-dir runs/glue/{wildcards.glue_task} --"
        " python -m workflow.glue.finetune --config {params.config:q}"
        " --task {wildcards.glue_task} --init {input.model:q} --vocab {input.vocab:q} --features {input.features:q}"
        " --output {output.model:q} --metrics {output.metrics:q} --run-dir runs/glue/{wildcards.glue_task}"
        " --threads {threads} 2> {log}"


rule glue_eval:
    input:
        unpack(glue_dev_features),
        model="results/glue/{glue_task}/model",
    output:
        report("results/glue/{glue_task}/eval.json", caption="../report/glue_eval.rst", category="GLUE",
               subcategory="{glue_task}"),
    params:
        features=glue_dev_feature_args,
        batch_size=config["glue"]["eval_batch_size"],
        precision=config["glue"]["precision"],
    threads: 8
    resources:
        gpus=1,
    log:
        "logs/glue_eval/{glue_task}.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.glue.evaluate --task {wildcards.glue_task} --model {input.model:q} {params.features}"
        " --output {output:q} --batch-size {params.batch_size} --precision {params.precision} --threads {threads}"
        " 2> {log}"
