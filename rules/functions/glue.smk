# Input and params functions of rules/glue.smk (functions apart from rules, as `snakemake --lint` asks).


def glue_file_url(wildcards):
    """Where a GLUE file is: <glue.url>/<task>/<file>.tsv, as download_glue_data.py lays GLUE out."""
    return f"{config['glue']['url'].rstrip('/')}/{wildcards.glue_task}/{wildcards.glue_file}.tsv"


def glue_max_seq_length(wildcards):
    return glue_setting(wildcards.glue_task, "max_seq_length")


def glue_dev_features(wildcards):
    """{dev split: its features}: dev, or MNLI's dev_matched and dev_mismatched."""
    return {split: f"data/glue/{wildcards.glue_task}/{split}_features.npz"
            for split in GLUE_TASKS[wildcards.glue_task].dev_splits}


def glue_dev_feature_args(wildcards, input):
    return " ".join(f"--features {split}={input[split]}" for split in GLUE_TASKS[wildcards.glue_task].dev_splits)


def glue_recipe(wildcards):
    """What changes a task's fine-tuned model (glue_finetune's params): not cadence, micro-batch size or threads."""
    keys = ("max_seq_length", "learning_rate", "epochs", "batch_size", "warmup_proportion", "weight_decay",
            "max_grad_norm", "precision")
    return {"seed": config["seed"], **{key: glue_setting(wildcards.glue_task, key) for key in keys}}
