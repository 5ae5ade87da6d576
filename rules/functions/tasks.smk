# Input and params functions of rules/tasks.smk (functions apart from rules, as `snakemake --lint` asks).
import re


def task_names(*types):
    """The configured tasks of these types."""
    return [name for name, task in config["tasks"].items() if task["type"] in types]


def names_pattern(names):
    """A wildcard constraint matching exactly these names (none: nothing)."""
    return "|".join(re.escape(name) for name in names) or "(?!)"


def task_file(wildcards):
    """The task's file of a split (train, dev, test), as the config names it."""
    return config["tasks"][wildcards.task][wildcards.task_split]


def task_entry(wildcards):
    """The task's config entry as JSON, less its recipe keys: its files, format, fields and labels make its features
    (a recipe change reruns fine-tuning only)."""
    task = config["tasks"][wildcards.task]
    return json.dumps({key: value for key, value in task.items() if key not in TASK_RECIPE_KEYS}, sort_keys=True)


def task_label_entry(wildcards):
    """What the label list depends on: the type, the train file and how it is read, the labels given."""
    task = config["tasks"][wildcards.task]
    return json.dumps({key: task.get(key) for key in ("type", "train", "format", "text_fields", "label_field",
                                                      "labels")}, sort_keys=True)


def task_max_seq_length(wildcards):
    return task_section(config, wildcards.task)["max_seq_length"]


def task_recipe(wildcards):
    """What changes a task's fine-tuned model (task_finetune's params): not cadence, micro-batch size or threads."""
    section = task_section(config, wildcards.task)
    keys = ("max_seq_length", "learning_rate", "epochs", "batch_size", "warmup_proportion", "weight_decay",
            "max_grad_norm", "precision")
    return {"seed": config["seed"], **{key: section[key] for key in keys}}


def qa_task_file(wildcards):
    return config["tasks"][wildcards.qa_task][wildcards.squad_split]


def qa_squad_section(wildcards):
    """The squad section a question-answering task fine-tunes and predicts with, its own keys applied."""
    return task_section(config, wildcards.qa_task)


def qa_finetune_config(wildcards, threads):
    """params.config of a question-answering task: seed and its squad section as JSON (not part of the rerun
    check: it takes `threads`, see config_sections)."""
    return json.dumps({"seed": config["seed"], "squad": task_section(config, wildcards.qa_task)}, sort_keys=True)


def qa_recipe(wildcards):
    section = task_section(config, wildcards.qa_task)
    keys = ("max_seq_length", "doc_stride", "max_query_length", "learning_rate", "epochs", "batch_size",
            "warmup_proportion", "weight_decay", "max_grad_norm", "precision", "version")
    return {"seed": config["seed"], **{key: section[key] for key in keys}}
