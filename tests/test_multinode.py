"""Past one node, on the multi-node test cluster (tests/slurm/start_cluster.sh: node1..node3, each slurmd in its own
network and UTS namespace, the host's filesystem shared).

Proves: a phase job of 2 nodes x 2 ranks (BERT's, ModernBERT's) runs its ranks on two hosts, meets at the first
node's bridge address (not loopback), and ends with the weights of a one-process run of the same global batch; a
node lost under it is requeued by Slurm and the phase resumes on the nodes left to the same weights; the demo's
grouped data jobs run on more than one node and give the bytes of a one-machine run; every rank of a node sees all
of the node's GPUs and takes its local rank's; a second job on a run directory refuses while the first is alive and
takes a dead one's over; a rank killed on the second node ends its step at once (not after srun's --wait) and the
phase resumes. Cluster tests skip where no cluster can be had (not root), never under CI=true.
"""
from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.slurm_cluster import (REPO, SNAKEMAKE_TIMEOUT_S, clean_env, copy_data, job_records,
                                          take_node_down)


# 2 nodes x 2 ranks (one per fake GPU), one core each: a node's 2 CPUs.
TWO_NODES = {"set-resources": {"pretrain_phase": {"nodes": 2, "gres": "gpu:2", "tasks_per_node": 2, "cpus_per_gpu": 1}}}
# The demo's phase 1 with a micro-batch that 4 ranks divide (32 = 8 x 4; the math does not depend on it), and its
# tiny model without dropout: each rank draws its own dropout masks, so only then do 4 ranks and one process agree.
FOUR_RANKS = {"pretrain": {"phase1": {"micro_batch_size": 8}}, "model": {"bert_config": "tiny_no_dropout.json"}}
# ModernBERT's the same way: the sample as BPE full sentences (tests/test_modernbert_dag.py), its tiny preset with
# every dropout key of its config at 0 (the presets' are 0 too: stated, not assumed), AdamW as in that test.
MODERNBERT_FOUR_RANKS = {
    "vocab": {"type": "bpe", "size": 1000}, "encode": {"objective": "full_sentences"},
    "model": {"family": "modernbert", "preset": "modernbert-tiny", "architecture": {
        "num_hidden_layers": 3, "embedding_dropout": 0.0, "mlp_dropout": 0.0, "attention_dropout": 0.0}},
    "pretrain": {"optimizer": "adamw", "phase1": {"micro_batch_size": 8}}}
# family: its config over the sample's, the fixture whose run directory holds its data (the BERT demo's as the
# cluster built it), and the fixture of its one-process phase 1
FAMILIES = {"bert": (FOUR_RANKS, "demo_data", "one_machine"),
            "modernbert": (MODERNBERT_FOUR_RANKS, "modernbert_one_machine", "modernbert_one_machine")}
RANK_LINE = re.compile(r"rank (\d+)/(\d+) \(local (\d+)\) on host (\S+), \S+, backend \S+, master (\S+) \((\S+)\):\d+")
# fp32 sums in another order (4 ranks' all-reduce vs one process), grown by the optimizer's steps: up to 1.03e-5
# (ModernBERT, AdamW) on a Xeon with AVX-512 FP16, where the bound was 1e-5. A lost or doubled micro-batch
# moves weights by the learning rate's scale (1e-2 here), orders of magnitude more.
TOLERANCE = 5e-5


def without_dropout(workdir: Path) -> None:
    """The bert_config.json FOUR_RANKS names, in the workdir its jobs run in."""
    from workflow.train.models.bert import BertConfig

    BertConfig.preset("tiny", vocab_size=2000, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0).to_json(workdir / "tiny_no_dropout.json")


def hosts() -> dict[str, str]:
    """Node name -> its address, as the nodes resolve them (the cluster's hosts file)."""
    lines = Path("/var/lib/slurm/test-cluster/hosts").read_text().split("\n")
    return {fields[1]: fields[0] for fields in (line.split() for line in lines) if len(fields) == 2}


def assert_close_weights(actual: dict, expected: dict, what: str) -> float:
    assert actual.keys() == expected.keys(), what
    worst = max((actual[key] - expected[key]).abs().max().item() for key in expected)
    assert worst <= TOLERANCE, f"{what}: weights differ by up to {worst:.3g}"
    return worst


def phase1_on_one_machine(directory: Path, config: dict, *targets: str) -> Path:
    """The sample's data and phase 1 with `config` built in `directory` without Slurm, phase 1 by one process (same
    global batch as the cluster's 4 ranks), and `targets` besides."""
    from tests.conftest import copy_workflow

    workdir = copy_workflow(directory)
    (workdir / "four_ranks.yaml").write_text(json.dumps(config))
    without_dropout(workdir)
    env = {**clean_env(), "SNAKEBERT_LOCAL_RANKS": "1"}
    result = subprocess.run(["timeout", str(SNAKEMAKE_TIMEOUT_S), "snakemake", "--cores", "2",
                             "results/pretrain/phase1/model", *targets, "--configfile", "sample/config.yaml",
                             str(REPO / "tests" / "slurm" / "config.yaml"), "four_ranks.yaml"], cwd=workdir, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((workdir / "results" / "pretrain" / "phase1" / "summary.json").read_text())
    assert summary["world_size"] == 1
    return workdir


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory):
    """The demo's data and phase 1 built on this machine without Slurm, phase 1 by one process (same global batch)."""
    return phase1_on_one_machine(tmp_path_factory.mktemp("one_machine") / "run", FOUR_RANKS, "data/hdf5_seq512")


@pytest.fixture(scope="module")
def modernbert_one_machine(tmp_path_factory):
    return phase1_on_one_machine(tmp_path_factory.mktemp("modernbert_one_machine") / "run", MODERNBERT_FOUR_RANKS)


def phase1_weights(workdir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(workdir / "results" / "pretrain" / "phase1" / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def one_process_phase1(one_machine):
    return phase1_weights(one_machine)


def rank_lines(log: str) -> list[tuple]:
    """(rank, world, local rank, host, master, master's address) of every rank line of a run's log."""
    return sorted({(int(m[1]), int(m[2]), int(m[3]), m[4], m[5], m[6]) for m in RANK_LINE.finditer(log)})


@pytest.mark.parametrize("family", FAMILIES)
def test_a_phase_job_on_two_nodes_runs_its_ranks_on_two_hosts_and_ends_like_one_process(family, new_run, request):
    config, data_fixture, one_process_fixture = FAMILIES[family]
    data, one_process = request.getfixturevalue(data_fixture), request.getfixturevalue(one_process_fixture)
    started = time.monotonic()
    run = new_run("two_nodes", profile=TWO_NODES)
    shutil.copytree(getattr(data, "path", data) / "data", run.path / "data", symlinks=True,
                    copy_function=shutil.copy2)  # a Run's or a one-machine workdir's, mtimes kept (up to date)
    without_dropout(run.path)
    process = run.start("results/pretrain/phase1/model", config=config)
    output, _ = process.communicate(timeout=SNAKEMAKE_TIMEOUT_S)
    assert process.returncode == 0, output[-3000:]
    (job,) = run.phase_jobs("phase1")
    nodes = subprocess.run(["scontrol", "show", "hostnames", job_records(job["JobID"])[0]["NodeList"]],
                           capture_output=True, text=True, check=True).stdout.split()
    assert len(nodes) == 2, nodes
    ranks = rank_lines(run.log_text("phase1"))
    assert [r[0] for r in ranks] == [0, 1, 2, 3] and {r[1] for r in ranks} == {4}, ranks
    assert {host: sorted(r[2] for r in ranks if r[3] == host) for host in nodes} == {n: [0, 1] for n in nodes}, ranks
    # Every rank meets at the first node (the batch host), by its bridge address: not loopback.
    assert {(r[4], r[5]) for r in ranks} == {(nodes[0], hosts()[nodes[0]])}, ranks
    assert not hosts()[nodes[0]].startswith("127.")
    summary = json.loads((run.path / "results" / "pretrain" / "phase1" / "summary.json").read_text())
    assert (summary["world_size"], summary["family"]) == (4, family)
    worst = assert_close_weights(run.weights("phase1"), phase1_weights(one_process), "2 nodes x 2 ranks vs one process")
    print(f"{family} 2x2 phase job: {time.monotonic() - started:.0f} s, weights within {worst:.2e} of one process")


def test_a_node_lost_under_a_two_node_phase_job_is_requeued_and_the_phase_ends_like_one_process(
        demo_data, new_run, one_process_phase1):
    started = time.monotonic()
    run = new_run("two_nodes_lost", profile=TWO_NODES)
    copy_data(demo_data, run)
    without_dropout(run.path)
    process = run.start("results/pretrain/phase1/model", config=FOUR_RANKS)
    job_id = run.wait_for_phase1_checkpoint(process)
    first_nodes = subprocess.run(["scontrol", "show", "hostnames", job_records(job_id)[0]["NodeList"]],
                                 capture_output=True, text=True, check=True).stdout.split()
    take_node_down(first_nodes[1], job_id, process)  # the second node: not the batch host
    output, _ = process.communicate(timeout=SNAKEMAKE_TIMEOUT_S)
    assert process.returncode == 0, output[-3000:]
    assert "None assigned" not in output
    runs = job_records(job_id)
    assert [r["State"] for r in runs] == ["NODE_FAIL", "COMPLETED"], runs  # one job id: requeued by Slurm
    assert [job["JobID"] for job in run.phase_jobs("phase1")] == [job_id]  # no second copy
    assert not run.active_jobs()
    log = run.log_text("phase1")
    resumed = re.search(r"resumed from \S+ at step (\d+)/\d+ \(\d+ sequences consumed, (\d+) ranks then, (\d+) now\)",
                        log)
    assert resumed and int(resumed.group(1)) >= 4 and resumed.groups()[1:] == ("4", "4"), log[-3000:]
    attempts = run.path / "logs" / "pretrain" / "phase1" / "attempts"
    kept = sorted(p.name for p in attempts.glob("*.log"))
    assert kept == [f"pretrain.job{job_id}.run0.log", f"pretrain.job{job_id}.run1.log"], kept
    first = (attempts / kept[0]).read_text()  # the interrupted run's log survives the requeued run's `2> {log}`
    assert f"Slurm job {job_id} run 0" in first and "resumed from" not in first, first[-2000:]
    worst = assert_close_weights(run.weights("phase1"), one_process_phase1, "node lost + requeued vs one process")
    print(f"2x2 node failure: {time.monotonic() - started:.0f} s, weights within {worst:.2e} of one process")


def test_the_grouped_data_jobs_run_on_several_nodes_and_give_the_bytes_of_one_machine(demo_data, one_machine):
    nodes = set()
    for job in demo_data.jobs():
        listed = job_records(job["JobID"])[0]["NodeList"]
        nodes.update(subprocess.run(["scontrol", "show", "hostnames", listed], capture_output=True, text=True,
                                    check=True).stdout.split())
    assert len(nodes) >= 2, nodes
    workdir = one_machine
    for directory in ("data/hdf5_seq128", "data/hdf5_seq512"):
        ours = sorted(p.relative_to(workdir / directory) for p in (workdir / directory).rglob("*") if p.is_file())
        theirs = sorted(p.relative_to(demo_data.path / directory) for p in (demo_data.path / directory).rglob("*")
                        if p.is_file())
        assert ours == theirs and ours, directory
        different = [str(p) for p in ours if not filecmp.cmp(workdir / directory / p, demo_data.path / directory / p,
                                                             shallow=False)]
        assert not different, f"{directory}: {different}"


def sbatch(tmp_path: Path, name: str, command: str, *options: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-p", "gpu", "--mem=500", "-t", "5", "-o", str(tmp_path / name),
                          *options, "--wrap", command], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                         check=True)
    return out.stdout.strip().split(";")[0]


def wait_until(what: str, condition, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def state(job_id: str) -> str:
    return job_records(job_id)[0]["State"] if job_records(job_id) else "PENDING"


def test_every_rank_sees_its_nodes_gpus_and_takes_its_local_ranks(cluster, tmp_path):
    # The launcher's own srun line in a 2-node job with 2 GPUs and 2 tasks per node.
    report = tmp_path / "ranks.jsonl"
    (tmp_path / "rank.py").write_text(
        "import json, os, socket, sys\n"
        "keys = ('SLURM_PROCID', 'SLURM_LOCALID', 'CUDA_VISIBLE_DEVICES', 'SLURM_STEP_GPUS')\n"
        "line = {**{key: os.environ.get(key) for key in keys}, 'host': socket.gethostname()}\n"
        "open(sys.argv[1], 'a').write(json.dumps(line) + '\\n')\n")
    job = sbatch(tmp_path, "gpus.out", f"{sys.executable} -m workflow.slurm.launch -- {sys.executable} "
                 f"{tmp_path / 'rank.py'} {report}", "--nodes=2", "--ntasks-per-node=2", "--gres=gpu:2",
                 "--cpus-per-task=1")
    wait_until(f"job {job}", lambda: state(job) not in ("PENDING", "RUNNING"))
    assert state(job) == "COMPLETED", (tmp_path / "gpus.out").read_text()
    ranks = [json.loads(line) for line in report.read_text().splitlines()]
    assert sorted(int(r["SLURM_PROCID"]) for r in ranks) == [0, 1, 2, 3]
    for r in ranks:  # all of the node's GPUs: peers stay reachable; the rank's device is cuda:<local rank>
        assert r["CUDA_VISIBLE_DEVICES"] == "0,1" and r["SLURM_STEP_GPUS"] == "0,1", r
    by_host = {}
    for r in ranks:
        by_host.setdefault(r["host"], []).append(int(r["SLURM_LOCALID"]))
    assert len(by_host) == 2 and all(sorted(local) == [0, 1] for local in by_host.values()), by_host


def test_a_second_job_on_a_run_directory_cancels_a_live_first_one_and_takes_it_over(cluster, tmp_path):
    # As after the Snakemake head died: the rerun's job finds the first still running on the run directory.
    from workflow.slurm import owner

    run_dir = tmp_path / "run"
    launch = f"{sys.executable} -m workflow.slurm.launch --run-dir {run_dir} --"
    first = sbatch(tmp_path, "first.out", f"{launch} sleep 600", "--ntasks=1")
    wait_until("the first job's claim", lambda: (run_dir / "owner.json").exists() and state(first) == "RUNNING")
    second = sbatch(tmp_path, "second.out", f"{launch} true", "--ntasks=1")
    wait_until(f"job {second}", lambda: state(second) not in ("PENDING", "RUNNING"))
    text = (tmp_path / "second.out").read_text()
    assert state(second) == "COMPLETED", text
    assert state(first).startswith("CANCELLED") and not owner.is_alive({"slurm_job": first})
    assert f"in use by Slurm job {first}" in text and "cancelling it" in text, text
    assert f"its owner Slurm job {first}" in text and "taking the run directory over" in text, text
    assert not (run_dir / "owner.json").exists()  # a finished job releases it


def test_without_slurm_a_live_process_owns_the_run_directory_and_a_dead_one_is_taken_over(tmp_path):
    from workflow.cli import UserError
    from workflow.slurm import owner

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        holder = {"host": os.uname().nodename, "pid": sleeper.pid, "start": owner._process_start(sleeper.pid)}
        assert owner.claim(tmp_path, holder) is None
        with pytest.raises(UserError, match=f"in use by process {sleeper.pid} on .*still alive"):
            owner.claim(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert owner.claim(tmp_path) == holder  # dead: taken over, the stale owner returned
    me = json.loads((tmp_path / "owner.json").read_text())
    assert me["pid"] == os.getpid() and owner.claim(tmp_path) is None  # claiming again is a no-op
    owner.release(tmp_path)
    assert not (tmp_path / "owner.json").exists()


def test_a_slurm_owner_that_slurm_no_longer_lists_is_taken_over(cluster, tmp_path):
    from workflow.slurm import owner

    holder = {"slurm_job": "999999999", "host": "node1", "pid": 4242}  # squeue: "Invalid job id specified"
    (tmp_path / "owner.json").write_text(json.dumps(holder) + "\n")
    assert owner.claim(tmp_path) == holder


def unreachable_controller(directory: Path) -> Path:
    """A copy of the installed slurm.conf whose controller is a closed port of this host, asked with no retry."""
    installed = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    if not shutil.which("squeue") or not installed.is_file():
        pytest.skip("Slurm's client commands are not installed here")
    lines = [line for line in installed.read_text().splitlines()
             if not line.startswith(("SlurmctldHost", "SlurmctldPort", "MessageTimeout", "TCPTimeout"))]
    conf = directory / "slurm.conf"
    conf.write_text("\n".join(["SlurmctldHost=localhost(127.0.0.1)", "SlurmctldPort=9", "MessageTimeout=1",
                               "TCPTimeout=1", *lines]) + "\n")
    return conf


@pytest.mark.parametrize("squeue", ["absent", "controller unreachable"])
def test_a_slurm_owner_whose_state_squeue_cannot_tell_is_never_taken_over(tmp_path, monkeypatch, squeue):
    # A run directory from the cluster rerun where Slurm is not installed, or squeue timing out on a busy
    # controller: neither proves the owner gone, and taking over a live job's directory would mix two runs.
    from workflow.cli import UserError
    from workflow.slurm import owner

    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    holder = {"slurm_job": "812", "host": "node1", "pid": 4242}
    (run_dir / "owner.json").write_text(json.dumps(holder) + "\n")
    if squeue == "absent":
        monkeypatch.setenv("PATH", str(elsewhere))
        why = r"`squeue` cannot run here \(\[Errno 2\]"
    else:
        monkeypatch.setenv("SLURM_CONF", str(unreachable_controller(elsewhere)))
        monkeypatch.setattr(owner, "SQUEUE_RETRY_S", 0.0)
        why = r"`squeue -j 812` failed 3 times \(slurm_load_jobs error: Unable to contact slurm controller"
    refusal = f"in use by Slurm job 812 .*cannot be told: {why}.*delete {run_dir}/owner.json"
    with pytest.raises(UserError, match=refusal):
        owner.claim(run_dir)
    assert json.loads((run_dir / "owner.json").read_text()) == holder
    assert [path.name for path in run_dir.iterdir()] == ["owner.json"]


def trainer_pid(job_id: str, rank: int) -> int | None:
    """The pid of the trainer of rank `rank` in Slurm job `job_id` (the nodes share this host's process table): the
    child of the launcher's guard of that rank, not one of its loader workers."""
    def read(pid, name: str) -> bytes:
        try:
            return (Path("/proc") / str(pid) / name).read_bytes()
        except OSError:
            return b""

    marks = (f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or b"workflow.train.pretrain" not in read(entry.name, "cmdline"):
            continue
        if all(mark in read(entry.name, "environ").split(b"\0") for mark in marks):
            parent = read(entry.name, "stat").rsplit(b")", 1)[-1].split()[1].decode()
            if b"--rank" in read(parent, "cmdline").split(b"\0"):
                return int(entry.name)
    return None


def test_a_rank_killed_on_the_second_node_ends_the_step_at_once_and_the_phase_resumes_like_one_process(
        demo_data, new_run, one_process_phase1):
    # As the OOM killer or a GPU fault kills one trainer: its peers must not idle for srun's --wait (300 s).
    run = new_run("rank_killed", profile=TWO_NODES)
    copy_data(demo_data, run)
    without_dropout(run.path)
    process = run.start("results/pretrain/phase1/model", config=FOUR_RANKS)
    job_id = run.wait_for_phase1_checkpoint(process)
    pid = trainer_pid(job_id, 3)  # ranks 2 and 3 run on the second node
    assert pid, f"no trainer of rank 3 in job {job_id}"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    history = run.path / "logs" / "pretrain" / "phase1" / "attempts" / "pretrain.history.jsonl"
    wait_until("the launcher's decision on the step", lambda: history.exists() and history.read_text().strip(), 60)
    ended_s = time.monotonic() - killed
    first = json.loads(history.read_text().splitlines()[0])
    assert (first["exit"], first["cause"], first["requeue"]) == (128 + signal.SIGKILL, "failure", True), first
    assert ended_s <= 30, f"the step ended {ended_s:.0f} s after rank 3's death"
    output, _ = process.communicate(timeout=SNAKEMAKE_TIMEOUT_S)
    assert process.returncode == 0, output[-3000:]
    assert [r["State"] for r in job_records(job_id)] == ["REQUEUED", "COMPLETED"], job_records(job_id)
    log = run.log_text("phase1")
    assert "launch: rank 3 on " in log and "died of SIGKILL: ending step" in log, log[-3000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)/", log)
    assert resumed and int(resumed.group(1)) >= 4, log[-3000:]
    worst = assert_close_weights(run.weights("phase1"), one_process_phase1, "rank killed + requeued vs one process")
    print(f"rank SIGKILL on the second node: step ended {ended_s:.1f} s after; weights within {worst:.2e}")


@pytest.mark.parametrize("ends, status, step_ended", [
    ("kill -9 $$", -signal.SIGKILL, True),       # the OOM killer, a GPU fault
    ("exit 1", 1, True),                          # an error (e.g. a peer's collective failed)
    ("exit 138", 138, False),                     # the time-limit stop, after the checkpoint barrier
    ("exit 143", 143, False),                     # SIGTERM's stop, after the checkpoint barrier
    ("exit 0", 0, False),
])
def test_a_ranks_guard_ends_its_step_only_when_the_rank_dies_or_fails_and_exits_as_the_rank_did(
        tmp_path, ends, status, step_ended):
    # Slurm's scancel, recorded: the real one runs in the cluster test above.
    (tmp_path / "scancel").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scancel.args'}\n")
    (tmp_path / "scancel").chmod(0o755)
    env = {**clean_env(), "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_PROCID": "1"}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    guard = subprocess.run([sys.executable, "-m", "workflow.slurm.launch", "--rank", "--", "sh", "-c", ends],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert guard.returncode == status, guard.stderr
    called = (tmp_path / "scancel.args").read_text() if (tmp_path / "scancel.args").exists() else ""
    assert called == ("--signal=KILL 7.3\n" if step_ended else ""), guard.stderr
    if step_ended:
        how = "died of SIGKILL" if status < 0 else f"exited with status {status}"
        assert f"launch: rank 1 on {os.uname().nodename} {how}: ending step 7.3 now" in guard.stderr
