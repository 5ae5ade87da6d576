"""The collectives of workflow/train/distributed.py on two real gloo ranks: the patient barrier (rank 0's export)
outlasts the process group's timeout, where a plain barrier does not, on any torch (barrier's own `timeout` argument
is recent: the group carries it)."""
import os
import socket
import time
from pathlib import Path

import torch

from workflow.train import distributed

GROUP_TIMEOUT_S, EXPORT_S = 1, 4


def _rank(rank: int, port: int, results: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    distributed.setup("cpu", timeout_s=GROUP_TIMEOUT_S)
    outcomes = []
    for barrier in (distributed.patient_barrier, lambda group: distributed.barrier()):
        group = distributed.patient_group()
        if rank == 0:
            time.sleep(EXPORT_S)  # an export slower than the process group's timeout
        try:
            barrier(group)
            outcomes.append("waited")
        except RuntimeError as error:
            outcomes.append("timed out" if "imed out" in str(error) else repr(error))
            break
    Path(results, f"rank{rank}").write_text(" ".join(outcomes))


def test_the_patient_barrier_outlasts_the_process_groups_timeout_where_a_plain_one_does_not(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(_rank, nprocs=2, args=(port, str(tmp_path)), join=True)
    assert (tmp_path / "rank1").read_text() == "waited timed out"
