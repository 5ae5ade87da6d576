# Stages 9-10: BERT pretraining, phase 1 (seq 128) then phase 2 (seq 512, initialised from phase 1's export).
# Checkpoints live in runs/pretrain/{phase}/ (not an output): a rerun after a crash, a Slurm time limit or a retry
# resumes from the newest valid checkpoint. `python -m workflow.train.distributed --` runs the trainer once per Slurm task
# (srun) when the job has several tasks, else once; rank/world/master come from the environment.
# GPU telemetry lands in results/pretrain/{phase}/gpu_telemetry.csv when a GPU exists (not declared: absent on CPU).


rule pretrain_phase1:
    input:
        data=hdf5_dir("phase1"),
        vocab="data/vocab.txt",
    output:
        model=directory("results/pretrain/phase1/model"),
        metrics="results/pretrain/phase1/metrics.jsonl",
        summary="results/pretrain/phase1/summary.json",
    params:
        train=config["pretrain"]["phase1"],
        common=config["pretrain"],
        max_steps=config["pretrain"]["phase1"].get("max_steps") or "",
        eval_max_sequences=config["pretrain"]["eval_max_sequences"] or "",
        preset=config["model"]["preset"],
        bert_config=config["model"]["bert_config"] or "",
        init_from=config["model"]["init_from"] or "",
        seed=config["seed"],
    log:
        "logs/pretrain_phase1/pretrain.log",
    threads: 8
    resources:
        gpus=1,
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.train.distributed -- python -m workflow.train.pretrain --phase phase1 --data-dir {input.data}"
        " --vocab {input.vocab} --run-dir runs/pretrain/phase1 --out-model {output.model}"
        " --out-metrics {output.metrics} --out-summary {output.summary}"
        " --out-telemetry results/pretrain/phase1/gpu_telemetry.csv --threads {threads}"
        " --learning-rate {params.train[learning_rate]} --warmup-proportion {params.train[warmup_proportion]}"
        " --total-steps {params.train[total_steps]} --max-steps={params.max_steps:q}"
        " --global-batch-size {params.train[global_batch_size]} --micro-batch-size {params.train[micro_batch_size]}"
        " --precision {params.common[precision]} --checkpoint-every {params.common[checkpoint_every]}"
        " --keep-checkpoints {params.common[keep_checkpoints]} --log-every {params.common[log_every]}"
        " --eval-max-sequences={params.eval_max_sequences:q} --preset {params.preset} --seed {params.seed}"
        " --bert-config={params.bert_config:q} --init-from={params.init_from:q} 2> {log}"


rule pretrain_phase2:
    input:
        data=hdf5_dir("phase2"),
        vocab="data/vocab.txt",
        init="results/pretrain/phase1/model",
    output:
        model=directory("results/pretrain/phase2/model"),
        metrics="results/pretrain/phase2/metrics.jsonl",
        summary="results/pretrain/phase2/summary.json",
    params:
        train=config["pretrain"]["phase2"],
        common=config["pretrain"],
        max_steps=config["pretrain"]["phase2"].get("max_steps") or "",
        eval_max_sequences=config["pretrain"]["eval_max_sequences"] or "",
        preset=config["model"]["preset"],
        seed=config["seed"],
    log:
        "logs/pretrain_phase2/pretrain.log",
    threads: 8
    resources:
        gpus=1,
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.train.distributed -- python -m workflow.train.pretrain --phase phase2 --data-dir {input.data}"
        " --vocab {input.vocab} --init-from {input.init} --run-dir runs/pretrain/phase2"
        " --out-model {output.model} --out-metrics {output.metrics} --out-summary {output.summary}"
        " --out-telemetry results/pretrain/phase2/gpu_telemetry.csv --threads {threads}"
        " --learning-rate {params.train[learning_rate]} --warmup-proportion {params.train[warmup_proportion]}"
        " --total-steps {params.train[total_steps]} --max-steps={params.max_steps:q}"
        " --global-batch-size {params.train[global_batch_size]} --micro-batch-size {params.train[micro_batch_size]}"
        " --precision {params.common[precision]} --checkpoint-every {params.common[checkpoint_every]}"
        " --keep-checkpoints {params.common[keep_checkpoints]} --log-every {params.common[log_every]}"
        " --eval-max-sequences={params.eval_max_sequences:q} --preset {params.preset} --seed {params.seed} 2> {log}"
