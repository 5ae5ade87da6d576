# Stages 9-10: BERT pretraining, phase 1 (seq 128) then phase 2 (seq 512, from phase 1's weights and LAMB moments).
# Checkpoints live in runs/pretrain/{phase}/ (not an output): a rerun after a crash, a Slurm time limit or a retry
# resumes from the newest valid checkpoint, on any number of ranks. `python -m workflow.slurm.launch --` runs
# the trainer once per Slurm task (srun) when the job has several tasks, else once; rank/world/master come from the
# environment. The trainer gets the config sections seed, model and pretrain whole (params.config, not part of the
# rerun check); params.recipe holds only what changes the outputs, so a cadence or micro-batch edit reruns nothing.
# GPU telemetry lands in results/pretrain/{phase}/gpu_telemetry.csv when a GPU exists (not declared: absent on CPU).


include: "functions/pretrain.smk"


warn_below_torch_floor()  # the jobs' torch below their attention's floor: one line here, before any job runs


rule pretrain_phase:
    input:
        unpack(pretrain_inputs),
    output:
        model=directory("results/pretrain/{phase}/model"),
        metrics="results/pretrain/{phase}/metrics.jsonl",
        summary="results/pretrain/{phase}/summary.json",
        optimizer_state="results/pretrain/{phase}/optimizer_state.pt",
    params:
        recipe=pretrain_recipe,
        config=config_sections("seed", "model", "pretrain"),
        init=pretrain_init_args,
        normalization=normalization_flags(),  # the exported tokenizer's
    log:
        "logs/pretrain/{phase}/pretrain.log",
    threads: 8
    retries: 0  # not even the profile's: a scancel must stop it; the launcher requeues its own job
    resources:
        gpus=1,
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.slurm.launch --run-dir runs/pretrain/{wildcards.phase} --"
        " python -m workflow.train.pretrain --phase {wildcards.phase}"
        " --config {params.config:q} --data-dir {input.data} --vocab {input.vocab} {params.normalization} {params.init}"
        " --run-dir runs/pretrain/{wildcards.phase} --out-dir results/pretrain/{wildcards.phase}"
        " --threads {threads} 2> {log}"


# Checkpoints in: a fine-tuning section's init_from naming an NVIDIA DLE checkpoint file (ckpt_*.pt) is imported
# once into an HF directory (with model.bert_config, vocab.file and vocab.lowercase, what DLE's scripts take as
# --config_file, --vocab_file and --do_lower_case). Checkpoints out: each phase's model/ holds dle_checkpoint.pt.
wildcard_constraints:
    finetune_section="squad|glue",


rule import_dle_checkpoint:
    input:
        unpack(dle_checkpoint_inputs),
    output:
        directory("data/init/{finetune_section}"),
    params:
        normalization=normalization_flags(),
        gelu=config["model"]["dle_gelu"],
    log:
        "logs/import_dle_checkpoint/{finetune_section}.log",
    conda:
        "../envs/train.yaml"
    shell:
        "python -m workflow.train.models.dle_checkpoint import --checkpoint {input.checkpoint:q}"
        " --bert-config {input.bert_config:q} --vocab {input.vocab:q} {params.normalization} --gelu {params.gelu}"
        " --output {output:q} 2> {log}"
