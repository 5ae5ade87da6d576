# Input and params functions of rules/squad.smk (functions apart from rules, as `snakemake --lint` asks).


def squad_recipe(wildcards):
    """What changes the fine-tuned model (squad_finetune's params): not cadence, micro-batch size or threads."""
    keys = ("learning_rate", "epochs", "batch_size", "warmup_proportion", "weight_decay", "max_grad_norm", "precision")
    return {"seed": config["seed"], **{key: config["squad"][key] for key in keys}}
