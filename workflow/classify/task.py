"""A sentence (pair) classification or regression task as the shared classification code sees it: its name, its
labels and the metrics it is scored by. The GLUE tasks are presets of it (workflow.glue.data.TASKS, which add where
their TSV columns are); a classification or regression task of the config's tasks section is one more
(workflow.tasks.data.sentence_task).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class SentenceTask:
    """A task's name, its labels (None: a float score, a regression) and its metrics (workflow.classify.metrics)."""

    name: str
    labels: tuple[str, ...] | None
    metrics: tuple[str, ...]

    @property
    def num_labels(self) -> int:
        return len(self.labels) if self.labels else 1
