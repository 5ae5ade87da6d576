"""The `tasks:` config section: what the schema cannot say about a task (its format, a name that is a GLUE
preset's), and a task's fine-tuning recipe (its own keys over the glue or squad section's).

API:
    task_format(task) -> "csv" | "tsv" | "jsonl" | "conll" | None (question answering)
    task_config_error(config) -> one line naming the key, or None
    task_section(config, name) -> the glue/squad section with the task's own recipe keys applied
"""
from pathlib import Path

from workflow.glue.data import TASKS as GLUE_TASKS

SUFFIX_FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".conll": "conll"}
RECIPE_KEYS = ("max_seq_length", "learning_rate", "epochs", "batch_size", "micro_batch_size", "warmup_proportion",
               "weight_decay", "max_grad_norm")


def task_format(task: dict) -> str | None:
    """The task's file format: its `format`, else its train file's suffix (None for question answering)."""
    if task["type"] == "question_answering":
        return None
    return task.get("format") or SUFFIX_FORMATS.get(Path(task["train"]).suffix.lower())


def task_config_error(config: dict) -> str | None:
    """One line naming the first bad key of the validated config's tasks section; None when they are consistent."""
    glue_names = {name.lower(): name for name in GLUE_TASKS}
    for name, task in config["tasks"].items():
        key = f"tasks.{name}"
        if name.lower() in glue_names:
            return (f"config key '{key}': the name of the GLUE preset {glue_names[name.lower()]} (list it in "
                    "glue.tasks, or give your task another name)")
        kind, form = task["type"], task_format(task)
        if kind != "question_answering" and form is None:
            return (f"config key '{key}.format': not given, and the train file {task['train']} has none of the "
                    f"suffixes {', '.join(SUFFIX_FORMATS)}")
        if form == "conll" and kind != "token_classification":
            return f"config key '{key}.format': conll holds tokens; it is for type token_classification, not {kind}"
        if kind == "token_classification" and len(task["text_fields"]) != 1:
            return f"config key '{key}.text_fields': token_classification takes one field (the list of words)"
        if kind == "question_answering" and task.get("test"):
            return f"config key '{key}.test': question_answering scores its dev file; it takes no test file"
        if kind == "regression" and task.get("labels"):
            return f"config key '{key}.labels': a regression task has no label list (its labels are numbers)"
        section = task_section(config, name)
        if section["batch_size"] % section["micro_batch_size"]:
            return (f"config key '{key}.batch_size': {section['batch_size']} is not a multiple of the micro-batch "
                    f"size {section['micro_batch_size']} ({key} may set either)")
    return None


def task_section(config: dict, name: str) -> dict:
    """The config section the task fine-tunes with (squad for question answering, else glue), its own keys on top."""
    task = config["tasks"][name]
    base = config["squad" if task["type"] == "question_answering" else "glue"]
    return {**base, **{key: task[key] for key in RECIPE_KEYS if key in task}}
