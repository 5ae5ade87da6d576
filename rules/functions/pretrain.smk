# Input and params functions of rules/pretrain.smk (functions apart from rules, as `snakemake --lint` asks).


def pretrain_inputs(wildcards):
    """A phase's data and vocab; phase 2 also starts from phase 1's export (and LAMB moments)."""
    inputs = {"data": hdf5_dir(wildcards.phase), "vocab": "data/vocab.txt"}
    if wildcards.phase == "phase2":
        inputs["init"] = "results/pretrain/phase1/model"
        if config["pretrain"]["carry_optimizer_state"]:
            inputs["init_optimizer"] = "results/pretrain/phase1/optimizer_state.pt"
    return inputs


def pretrain_init_args(wildcards):
    """The trainer's --init-from/--init-optimizer for phase 2 (phase 1 starts from config model.init_from)."""
    inputs = pretrain_inputs(wildcards)
    args = [f"--init-from {inputs['init']}"] if "init" in inputs else []
    if "init_optimizer" in inputs:
        args.append(f"--init-optimizer {inputs['init_optimizer']}")
    return " ".join(args)


def pretrain_recipe(wildcards):
    """What changes a phase's outputs (its params): the math, precision, max_steps and the evaluation size; not
    cadence, micro-batch size or threads."""
    pretrain = config["pretrain"]
    recipe = {key: value for key, value in pretrain[wildcards.phase].items() if key != "micro_batch_size"}
    recipe.update(lamb=pretrain["lamb"], precision=pretrain["precision"], seed=config["seed"],
                  eval_max_sequences=pretrain["eval_max_sequences"], model=config["model"])
    if wildcards.phase == "phase2":
        recipe["carry_optimizer_state"] = pretrain["carry_optimizer_state"]
        recipe["model"] = {k: v for k, v in config["model"].items() if k != "init_from"}  # phase 1's export
    return recipe
