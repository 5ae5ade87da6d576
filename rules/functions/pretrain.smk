# Input and params functions of rules/pretrain.smk (functions apart from rules, as `snakemake --lint` asks).


def pretrain_inputs(wildcards):
    """A phase's data and vocab; a later phase also starts from the previous one's export (and LAMB moments)."""
    inputs = {"data": hdf5_dir(wildcards.phase), "vocab": VOCAB}
    if wildcards.phase != PHASES[0]:
        previous = f"results/pretrain/{PHASES[PHASES.index(wildcards.phase) - 1]}"
        inputs["init"] = f"{previous}/model"
        if config["pretrain"]["carry_optimizer_state"]:
            inputs["init_optimizer"] = f"{previous}/optimizer_state.pt"
    return inputs


def pretrain_init_args(wildcards):
    """The trainer's --init-from/--init-optimizer for phase 2 (phase 1 starts from config model.init_from)."""
    inputs = pretrain_inputs(wildcards)
    args = [f"--init-from {inputs['init']}"] if "init" in inputs else []
    if "init_optimizer" in inputs:
        args.append(f"--init-optimizer {inputs['init_optimizer']}")
    return " ".join(args)


def pretrain_recipe(wildcards):
    """What changes a phase's outputs (its params): the math, precision, max_steps and the evaluation set; not
    cadence (eval_every included: a rerun would not revisit trained steps), micro-batch size or threads."""
    pretrain = config["pretrain"]
    recipe = {key: value for key, value in pretrain[wildcards.phase].items() if key != "micro_batch_size"}
    optimizer = pretrain["optimizer"]
    # LAMB's recipe as before AdamW existed (no rerun of finished phases); another optimizer's names its section
    recipe.update({"lamb": pretrain["lamb"]} if optimizer == "lamb" else {"optimizer": optimizer,
                                                                            optimizer: pretrain[optimizer]})
    recipe.update(precision=pretrain["precision"], seed=config["seed"],
                  eval_max_sequences=pretrain["eval_max_sequences"], eval_seed=pretrain["eval_seed"],
                  model=config["model"])
    if wildcards.phase != PHASES[0]:
        recipe["carry_optimizer_state"] = pretrain["carry_optimizer_state"]
        recipe["model"] = {k: v for k, v in config["model"].items() if k != "init_from"}  # phase 1's export
    return recipe


def warn_below_torch_floor():
    """At parse time on the head (`snakemake -n` included), before any job is submitted: the warning a pretraining
    job will log where it starts when its torch is below its attention path's floor (workflow/train/models/kernels.py,
    docs/gpu.md), where the head knows that torch: under conda the pin of envs/train.yaml; without a deployment method
    this interpreter's (every job runs the python active at submission, locally or through Slurm's --export=ALL);
    in a container, nothing is known here. Not inside a job (it warns itself). Below workflow/train/models/floors.py's
    TORCH_FLOOR every training job would stop at its start: that is said here too."""
    methods = workflow.deployment_settings.deployment_method  # Snakemake 9's --sdm, a set of DeploymentMethod
    if not workflow.is_main_process or "APPTAINER" in {method.name for method in methods}:
        return
    from snakemake.logging import logger
    from workflow.train.models.floors import head_floor_warning

    env_file = f"{REPO_ROOT}/envs/train.yaml" if "CONDA" in {method.name for method in methods} else None
    warning = head_floor_warning(config["model"]["family"], config["pretrain"]["precision"],
                                 config["encode"]["packing"]["enabled"], env_file)
    if warning:
        logger.warning(f"warning: {warning}")


# ---- Where fine-tuning (squad, glue) starts: checkpoints in (rules/pretrain.smk's import_dle_checkpoint)


def finetune_init(section):
    """The HF directory `section` (squad, glue) fine-tunes: our phase-2 export, its init_from directory, or the import
    of its init_from file (an NVIDIA DLE checkpoint, with model.bert_config and vocab.file); refused at parse time
    when such a file lacks either key."""
    init = config[section]["init_from"]
    if not init:
        return f"results/pretrain/{PHASES[-1]}/model"
    if not os.path.isfile(init):
        return init
    if not model_family(config["model"]["family"]).reads_dle_checkpoints:
        raise ValueError(f"config key '{section}.init_from': {init} is a file, read as an NVIDIA DLE checkpoint, which "
                         f"model.family {config['model']['family']} does not read; it fine-tunes from a Hugging Face "
                         "directory (config.json, model.safetensors)")
    if not (config["model"]["bert_config"] and config["vocab"]["file"]):
        raise ValueError(f"config key '{section}.init_from': {init} is a file, read as an NVIDIA DLE checkpoint: set "
                         "model.bert_config to its bert_config.json and vocab.file to its vocab.txt (vocab.lowercase: "
                         "its casing)")
    return f"data/init/{section}"


def finetune_vocab(section):
    """The vocab `section`'s features are made with: the fine-tuned model's own (an HF directory's vocab.txt or
    tokenizer.json, whichever it has: a ModernBERT's is a tokenizer.json whatever vocab.type says)."""
    init = config[section]["init_from"]
    if not init:
        return VOCAB
    if os.path.isfile(init):
        return config["vocab"]["file"]
    own = [name for name in VOCAB_FILES.values() if os.path.isfile(os.path.join(init, name))]
    return f"{init}/{own[0] if own else VOCAB_FILES[config['vocab']['type']]}"


def finetune_tokenizer(section):
    """An input function: {"tokenizer": the fine-tuned directory's tokenizer_config.json} where it has one (its
    casing wins), else {}."""
    init = config[section]["init_from"]
    path = os.path.join(init, "tokenizer_config.json") if init and os.path.isdir(init) else None

    def tokenizer_input(wildcards):
        return {"tokenizer": path} if path and os.path.isfile(path) else {}

    return tokenizer_input


def tokenizer_args(wildcards, input):
    """A featurizer's casing: the model's tokenizer_config.json (input.tokenizer) if any, else config vocab's normalisation (how
    our own vocab, and a DLE checkpoint's vocab.file, is cased)."""
    if "tokenizer" in input.keys():
        return f"--tokenizer-config {input.tokenizer}"
    return normalization_flags()


def dle_checkpoint_inputs(wildcards):
    """A DLE checkpoint to import for fine-tuning, with the bert_config.json and vocab.txt it was trained with."""
    return {"checkpoint": config[wildcards.finetune_section]["init_from"], "bert_config": config["model"]["bert_config"],
            "vocab": config["vocab"]["file"]}
