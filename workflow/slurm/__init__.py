"""The cluster side: the launcher of training jobs (`launch`), retries by cause inside a job (`attempts`), deriving and
checking a cluster profile (`profile`), and the first-run check of a new cluster (`cluster_check`). Nothing outside
this package runs a Slurm command."""
