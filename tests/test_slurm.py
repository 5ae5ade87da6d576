"""The demo DAG on the real multi-node Slurm test cluster (tests/slurm/start_cluster.sh) through profiles/slurm.

Proves: every job went through sbatch (sacct lists it with its rule, GPU rules with their GPUs); the data half
is a handful of grouped jobs; a phase-1 job that dies midway is rerun alone on the next invocation and resumes
from its checkpoint; a phase-1 job stopped by Slurm's warning signal checkpoints and its launcher requeues it;
a scancel stops the run naming the cancel, never resubmitted (a node failure: tests/test_multinode.py); a head
killed mid-phase is rerun and its running job taken over from its checkpoint; a GPU job with fewer ranks than GPUs
stops with one `error:` line; cluster_check runs the real trainer on 2 nodes; the profile check rejects requests no
node can satisfy, a runtime over the partition's MaxTime, an unknown QOS and a training job without its signal. The launcher's srun line, rank guard and retry decisions
are also tested without a cluster. Cluster tests skip where no cluster can be started (not root), never
under CI=true.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from tests.fixtures.slurm_cluster import REPO, SNAKEMAKE_TIMEOUT_S, clean_env, copy_data, job_records
from workflow.slurm.profile import derive, merge

PHASES = ("phase1", "phase2")  # one rule `pretrain_phase`, its jobs told apart by the wildcard {phase}
FAIL_AT_STEP = 6  # between the checkpoints at steps 4 and 8 (tests/slurm/config.yaml: checkpoint_every 4)
# The demo's data half as grouped Slurm jobs (profiles/slurm `groups`; a group job is named <group>_<its rules>):
# the downloads, the dump parts' template pages, their one compiled template file, their extracts, the one punkt
# job, the formats (the dump's and the books'), the shard split, the vocab, tokenize+encode of all shards, and one
# hdf5 directory per sequence length.
DATA_JOBS = {"download_download_bookcorpus_download_wikipedia": 1, "templates_wikipedia_templates": 1,
             "compile_templates": 1, "extract_extract_wikipedia": 1, "punkt": 1, "format_format": 1, "shard": 1,
             "vocab": 1, "shard_encode_tokenize": 1, "hdf5_dir": 2}
DATA_RULES = set(DATA_JOBS)  # the rule or group names sacct shows for them

# (tests/conftest.py runs every cluster test in one xdist worker, in turn; tests/fixtures/slurm_cluster.py: the
# fixtures `cluster`, `new_run`, `demo_data`.)


def assert_same_weights(actual: dict, expected: dict, what: str) -> None:
    import torch

    assert actual.keys() == expected.keys(), what
    different = [key for key in expected if not torch.equal(actual[key], expected[key])]
    assert not different, f"{what}: {len(different)} tensors differ, e.g. {different[:3]}"





def test_demo_dag_runs_on_slurm_and_a_failed_phase1_reruns_alone_from_its_checkpoint(demo_data, new_run):
    # The demo's data half ran on Slurm once (the demo_data fixture: its jobs are checked below); from there `all`.
    run = new_run("crash")
    copy_data(demo_data, run)
    # First invocation: phase 1 SIGKILLs itself after step FAIL_AT_STEP; keep-going finishes what it can.
    first = run.snakemake("all", env_extra={"SNAKEBERT_FAIL_AT_STEP": str(FAIL_AT_STEP)})
    assert first.returncode != 0, "phase 1 was meant to fail"
    first_jobs = run.jobs()
    assert first_jobs, "sacct lists no job of this workdir: nothing went through sbatch"
    rules = {job["rule"] for job in first_jobs}
    assert not rules & DATA_RULES, f"data rules rerun on up-to-date data: {rules & DATA_RULES}"
    assert all(job["SubmitLine"].startswith("sbatch ") for job in first_jobs + demo_data.jobs())
    phase1 = [job for job in first_jobs if job["rule"] == "pretrain_phase" and job["wildcards"] == "phase1"]
    assert len(phase1) == 1 and phase1[0]["State"] == "FAILED", phase1
    assert phase1[0]["DerivedExitCode"] == "0:9", phase1  # its trainer step died of SIGKILL
    assert not (run.path / "results" / "pretrain" / "phase1" / "model").exists()

    # Second invocation, nothing changed but the fault is gone: only phase 1 and what follows it run.
    second = run.snakemake("all")
    assert second.returncode == 0, second.stderr[-3000:]
    second_jobs = [job for job in run.jobs() if int(job["JobID"]) > max(int(j["JobID"]) for j in first_jobs)]
    rerun = {job["rule"] for job in second_jobs}
    assert [job["wildcards"] for job in second_jobs if job["rule"] == "pretrain_phase"] == ["phase1", "phase2"], second_jobs
    assert not rerun & DATA_RULES, f"second invocation ran {sorted(rerun)}"
    assert all(job["State"] == "COMPLETED" for job in second_jobs), second_jobs
    # One allocation with 2 (fake) GPUs ran 2 trainer processes: one rank per GPU.
    summary = json.loads((run.path / "results" / "pretrain" / "phase1" / "summary.json").read_text())
    assert summary["world_size"] == 2, summary["world_size"]
    log = run.log_text("phase1")
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert resumed and int(resumed.group(1)) == FAIL_AT_STEP - FAIL_AT_STEP % 4, log[-2000:]

    # Every GPU rule asked Slurm for GPUs, in one allocation per job, on the gpu partition.
    jobs = run.jobs()
    by_rule = {job["rule"]: job for job in jobs}
    phase_jobs = {phase: [job for job in jobs if job["rule"] == "pretrain_phase" and job["wildcards"] == phase][-1]
                  for phase in PHASES}
    gpu_jobs = [*phase_jobs.values(), *(by_rule[rule] for rule in ("squad_finetune", "squad_predict",
                                                                   "glue_finetune", "glue_eval"))]
    for job in gpu_jobs:
        assert "gres/gpu=" in job["AllocTRES"] and job["Partition"] == "gpu", job
    for job in phase_jobs.values():
        assert "--ntasks-per-node=2" in job["SubmitLine"], job["SubmitLine"]
        assert "--signal=USR1@" in job["SubmitLine"], job["SubmitLine"]
    for job in demo_data.jobs():  # and no data job did
        assert "gres/gpu" not in job["AllocTRES"] and job["Partition"] != "gpu", job

    # The resumed phase ends with the weights of an uninterrupted phase 1 on the same data and layout.
    reference = new_run("reference")
    copy_data(run, reference)
    result = reference.snakemake("results/pretrain/phase1/model")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [(job["rule"], job["wildcards"]) for job in reference.jobs()] == [("pretrain_phase", "phase1")]
    assert_same_weights(run.weights("phase1"), reference.weights("phase1"), "crashed+resumed vs uninterrupted")

    # Slurm's time-limit warning (the same SIGUSR1 to the job's steps that --signal=USR1@N sends): the trainers
    # checkpoint and exit 138, the launcher requeues its job, the phase resumes, and the weights are again those
    # of the reference.
    signalled = new_run("signalled")
    copy_data(run, signalled)
    process = signalled.start("results/pretrain/phase1/model")
    job_id = signalled.wait_for_phase1_checkpoint(process)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    output, _ = process.communicate(timeout=SNAKEMAKE_TIMEOUT_S)
    assert process.returncode == 0, output[-3000:]
    assert [job["JobID"] for job in signalled.phase_jobs("phase1")] == [job_id]
    assert [r["State"] for r in job_records(job_id)] == ["REQUEUED", "COMPLETED"], job_records(job_id)
    history = [json.loads(line) for line in (signalled.path / "logs" / "pretrain" / "phase1" / "attempts" /
                                             "pretrain.history.jsonl").read_text().splitlines()]
    assert [(h["exit"], h["requeue"]) for h in history] == [(138, True), (0, False)], history
    resumed = re.search(r"resumed from \S+ at step (\d+)", signalled.log_text("phase1"))
    assert resumed and int(resumed.group(1)) >= 4, signalled.log_text("phase1")[-2000:]
    assert_same_weights(signalled.weights("phase1"), reference.weights("phase1"), "signalled+requeued vs reference")


def test_profile_resolves_by_bare_name_from_the_repo_root(workflow_copy):
    # `snakemake --profile slurm` as typed in the README: Snakemake looks in the current directory first.
    # (In a scratch copy: the checkout may hold a demo's outputs, and then nothing would be planned.)
    link = workflow_copy / "slurm"
    assert link.is_symlink() and link.resolve() == (workflow_copy / "profiles" / "slurm").resolve()
    # (env-modules instead of the profile's conda: no conda here, and no rule declares envmodules)
    result = subprocess.run(["snakemake", "--profile", "slurm", "--dry-run", "--software-deployment-method",
                             "env-modules", "--configfile", "sample/config.yaml", "--", "all"], cwd=workflow_copy,
                            env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Using profile slurm" in result.stderr
    phases = re.findall(r"^rule pretrain_phase:\n(?:    .*\n)*?    wildcards: phase=(\w+)$", result.stdout, re.M)
    assert sorted(phases) == ["phase1", "phase2"], result.stdout[-3000:]


# ---------------------------------------------------------------- the launcher (no cluster needed)

SCONTROL_2x4 = ("JobId=812 JobName=3f1c-run Comment=rule_pretrain_phase_wildcards_phase1 Restarts=0 BatchHost=gpu01 "
                "NumNodes=2 NumCPUs=64 NumTasks=8 CPUs/Task=1 TRES=cpu=64,mem=500G,node=2,billing=64,gres/gpu=8 "
                "TresPerNode=gres:gpu:a100:4 NodeList=gpu[01-02]")


def test_launcher_runs_tasks_per_node_ranks_each_with_its_share_of_the_node_cores_and_all_its_gpus():
    from workflow.slurm.launch import SlurmJob, srun_command

    job = SlurmJob.parse(SCONTROL_2x4)
    assert (job.nodes, job.tasks, job.gpus_per_node, job.rule, job.batch_host) == (2, 8, 4, "pretrain_phase", "gpu01")
    # No --gpus-per-task: each rank sees its node's GPUs (peer-to-peer stays possible) and takes its local rank's.
    assert srun_command(job, ["python", "t.py"]) == [
        "srun", "--ntasks=8", "--nodes=2", "--ntasks-per-node=4", "--cpus-per-task=8",
        "--kill-on-bad-exit=0", "--wait=300", sys.executable, "-m", "workflow.slurm.launch", "--rank", "--", "python",
        "t.py"]


def test_a_gpu_job_whose_ranks_differ_from_its_gpus_stops_naming_the_profile_keys():
    from workflow.cli import UserError
    from workflow.slurm.launch import SlurmJob, check_one_rank_per_gpu, srun_command

    job = SlurmJob.parse(SCONTROL_2x4)
    check_one_rank_per_gpu(job, 8)
    with pytest.raises(UserError) as error:
        check_one_rank_per_gpu(job, 1)  # e.g. the plugin wrapped the launcher in `srun -n1`
    message = str(error.value)
    assert "1 rank(s) on 8 GPU(s)" in message and "rule pretrain_phase)" in message
    assert all(key in message for key in ("tasks_per_node", "gres", "mpi")), message
    uneven = SlurmJob.parse(SCONTROL_2x4.replace("NumTasks=8", "NumTasks=7"))
    with pytest.raises(UserError, match="tasks_per_node"):
        srun_command(uneven, ["x"])  # 7 tasks on 2 nodes: no per-node layout gives each rank one GPU


def test_the_rendezvous_port_is_one_the_os_found_free_not_one_derived_from_the_job_id():
    import socket

    from workflow.slurm.launch import free_port

    with socket.socket() as held:  # a port another job on the node holds
        held.bind(("", free_port()))
        taken = held.getsockname()[1]
        assert all(free_port() != taken for _ in range(20))


def test_training_jobs_are_requeued_by_cause():
    from workflow.slurm.attempts import TIME_LIMIT_EXIT, decide

    assert not decide(0, None, 12, 0).requeue
    assert decide(TIME_LIMIT_EXIT, 4, 8, 0).requeue            # time limit with progress: again and again
    assert decide(TIME_LIMIT_EXIT, 4, 8, 5).requeue
    assert decide(TIME_LIMIT_EXIT, None, 4, 0).requeue
    stuck = decide(TIME_LIMIT_EXIT, 8, 8, 0)                   # time limit without a new checkpoint: stop
    assert not stuck.requeue and "runtime" in stuck.why
    assert decide(137, 4, 4, 0).requeue                        # a genuine failure: once
    assert not decide(1, 4, 4, 1).requeue
    node_failure = decide(0, 4, 5, 0, job_state="NODE_FAIL")   # srun may even return 0: Slurm requeues it
    assert not node_failure.requeue and "NODE_FAIL" in node_failure.why


# ---------------------------------------------------------------- faults on the real cluster


def test_the_demo_data_half_runs_as_a_handful_of_grouped_slurm_jobs(demo_data):
    jobs = demo_data.jobs()
    counts = {rule: sum(1 for job in jobs if job["rule"] == rule) for rule in {job["rule"] for job in jobs}}
    assert counts == DATA_JOBS, counts
    assert all(job["State"] == "COMPLETED" for job in jobs), jobs


def test_scancel_of_a_running_phase_job_stops_the_run_naming_the_cancel(demo_data, new_run):
    run = new_run("cancelled")
    copy_data(demo_data, run)
    process = run.start("results/pretrain/phase1/model")
    job_id = run.wait_for_phase1_checkpoint(process)
    subprocess.run(["scancel", job_id], check=True)
    output, _ = process.communicate(timeout=SNAKEMAKE_TIMEOUT_S)  # the plugin polls at most every 180 s
    assert process.returncode not in (0, 124, 137), output[-3000:]
    assert f"SLURM-job '{job_id}' failed, SLURM status is: 'CANCELLED'" in output, output[-3000:]
    phase1 = run.phase_jobs("phase1")
    assert [job["JobID"] for job in phase1] == [job_id], phase1  # never resubmitted
    assert phase1[0]["State"].startswith("CANCELLED"), phase1
    assert not run.active_jobs()


def test_a_head_killed_mid_phase_is_rerun_and_its_running_job_taken_over_from_its_checkpoint(demo_data, new_run):
    # The Snakemake head dies hard (kill -9: a lost login node, the OOM killer) while phase 1 runs. The Slurm job runs
    # on; the rerun (after `--unlock`: the dead head's lock stays) submits phase 1 again, and that job cancels the
    # first (its trainers checkpoint on Slurm's SIGTERM) and resumes from the newest checkpoint: nothing is lost.
    run = new_run("head")
    copy_data(demo_data, run)
    longer = {"pretrain": {"phase1": {"total_steps": 300}}}  # long enough to outlive its head by a minute
    process = run.start("results/pretrain/phase1/model", config=longer)
    job_id = run.wait_for_phase1_checkpoint(process)
    for head in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split():
        os.kill(int(head), 9)
    process.communicate(timeout=60)
    assert job_records(job_id)[0]["State"] == "RUNNING"  # a head's death does not stop its jobs
    for args in (["--unlock"], ["results/pretrain/phase1/model"]):
        rerun = run.start(*args, config=longer)
        output, _ = rerun.communicate(timeout=SNAKEMAKE_TIMEOUT_S)
        assert rerun.returncode == 0, output[-3000:]
    jobs = run.phase_jobs("phase1")
    assert [job["JobID"] for job in jobs][0] == job_id and len(jobs) == 2, jobs
    assert jobs[0]["State"].startswith("CANCELLED") and jobs[1]["State"] == "COMPLETED", jobs
    log = run.log_text("phase1")
    assert f"in use by Slurm job {job_id}" in log and "cancelling it" in log, log[-3000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= 4, log[-3000:]  # the first job's work, not step 0
    summary = json.loads((run.path / "results" / "pretrain" / "phase1" / "summary.json").read_text())
    assert summary["steps"] == 300, summary


# A node failure under a running phase job (Slurm requeues it, it resumes from its checkpoint, no second job, its
# earlier run's log kept): tests/test_multinode.py, on a job of 2 nodes.


# ---------------------------------------------------------------- sizing


def test_a_request_no_node_of_its_partition_can_satisfy_is_one_error_line_naming_rule_and_key():
    from workflow.slurm.profile import check, merge, parse_sinfo, read_profile

    nodes = parse_sinfo("".join(f"cpu* node{i} 2 21694 (null)\ngpu node{i} 2 21694 gpu:a100:2(S:0)\n"
                                for i in (1, 2, 3)))
    stock = read_profile(REPO / "profiles" / "slurm")
    problems = check(stock, nodes, where="slurm")
    assert "slurm: set-resources pretrain_phase: gres asks 4 GPUs per node; partition gpu has at most 2" in problems
    assert "slurm: set-resources pretrain_phase: mem_mb asks 256000 MB of memory per node; partition gpu has at " \
           "most 21694" in problems
    assert "slurm: group jobs: cores asks 32 CPUs per node; the default partition has at most 2" in problems
    small = merge(stock, yaml.safe_load((REPO / "tests" / "slurm" / "profile.yaml").read_text()))
    assert check(small, nodes) == []
    # A profile that inherits keeps every key it does not name: here the phase keeps its GPUs and partition.
    assert small["set-resources"]["pretrain_phase"]["slurm_partition"] == "gpu"
    assert check(merge(small, {"set-resources": {"squad_predict": {"slurm_partition": "a100"}}}), nodes) == [
        "profile: set-resources squad_predict: slurm_partition=a100 is not a partition here (sinfo: cpu, gpu)"]


def test_profile_check_on_the_test_cluster_rejects_the_stock_profile_and_accepts_the_small_one(cluster, tmp_path):
    derive(REPO / "profiles" / "slurm", REPO / "tests" / "slurm" / "profile.yaml", tmp_path / "small")
    check = [sys.executable, "-m", "workflow.slurm.profile", "check"]
    stock = subprocess.run([*check, "profiles/slurm"], cwd=REPO, capture_output=True, text=True, env=clean_env())
    assert stock.returncode == 1 and not stock.stdout
    lines = stock.stderr.splitlines()
    assert all(line.startswith("error: profiles/slurm/config.v8+.yaml: ") for line in lines), lines
    assert any("set-resources pretrain_phase: gres asks 4 GPUs per node" in line for line in lines), lines
    small = subprocess.run([*check, str(tmp_path / "small")], cwd=REPO, capture_output=True, text=True,
                           env=clean_env())
    assert small.returncode == 0, small.stderr


def test_slurm_time_limits_parse_to_minutes():
    from workflow.slurm.profile import parse_time_limit, parse_time_limits

    assert [parse_time_limit(t) for t in ("infinite", "UNLIMITED", "30", "30:30", "2:00:00", "1-00:00:00", "2-12",
                                          "1-01:30")] == [None, None, 30, 30.5, 120, 1440, 3600, 1530]
    assert parse_time_limits("cpu* 1-00:00:00\ngpu 2:00:00\n") == {"cpu": 1440, "*": 1440, "gpu": 120}


def test_profile_check_rejects_over_max_time_threads_unknown_qos_lost_signal_and_gpu_rule_without_gpus():
    from workflow.slurm.profile import check, gpu_rules, merge, parse_sinfo, read_profile, rule_threads

    nodes = parse_sinfo("".join(f"cpu* node{i} 2 21694 (null)\ngpu node{i} 2 21694 gpu:2\n" for i in (1, 2)))
    small = merge(read_profile(REPO / "profiles" / "slurm"),
                  yaml.safe_load((REPO / "tests" / "slurm" / "profile.yaml").read_text()))
    cluster = {"time_limits": {"cpu": None, "*": None, "gpu": 60}, "qos": {"normal"}, "threads": rule_threads(),
               "gpus": gpu_rules()}
    assert {"pretrain_phase", "squad_finetune", "glue_eval", "task_finetune", "qa_task_predict"} <= cluster["gpus"]
    assert check(small, nodes, **cluster) == []
    site = merge(small, {"slurm-qos": "gpu_long", "max-threads": None,
                         "set-resources": {"pretrain_phase": {"runtime": 2880, "slurm_extra": "--exclusive"},
                                           "squad_finetune": {"slurm_extra": "--signal=USR1@600 --exclusive"}}})
    site["set-resources"] = {rule: res for rule, res in site["set-resources"].items() if rule != "task_predict"}
    assert check(site, nodes, where="site", **cluster) == [
        "site: set-resources pretrain_phase: slurm_extra '--exclusive' lacks --signal=USR1@<seconds>: without Slurm's "
        "warning its trainers lose what they did since their last checkpoint at the time limit (add your sbatch "
        "options after the signal, not instead of it)",
        "site: set-resources squad_finetune: --signal=USR1@600 comes 600 s before the end of a 10-minute job: at its "
        "start",
        "site: rule task_predict needs a GPU, but set-resources gives it no gres: add a set-resources task_predict "
        "entry like glue_eval's (slurm_partition and gres)",
        "site: set-resources pretrain_phase: runtime 2880 min exceeds the MaxTime of partition gpu (60 min): set a runtime "
        "within it (a training job requeues itself and resumes)",
        "site: slurm-qos: qos=gpu_long is not a QOS here (sacctmgr show qos: normal)",
        *[f"site: rule {rule}: threads asks {n} CPUs per node; the default partition has at most 2"
          for rule, n in (("hdf5_dir", 16), ("compile_templates", 16), ("punkt", 16), ("shard", 16),
                          ("task_predict", 8), ("vocab", 16))],
    ]


def test_deriving_a_profile_whose_overrides_key_no_job_rule_is_one_error_line_per_key(tmp_path):
    """A site file written for an earlier release keys the phases as `pretrain` (now the target that builds them):
    Snakemake would ignore the key without a word and run both phases without their GPUs."""
    from workflow.cli import UserError
    from workflow.slurm.profile import derive

    overrides = tmp_path / "my-cluster.yaml"
    overrides.write_text("set-resources:\n  pretrain: {nodes: 2}\n  squad_finetune: {runtime: 60}\n"
                         "set-threads: {tokenise: 4}\n")
    with pytest.raises(UserError) as raised:
        derive(REPO / "profiles" / "slurm", overrides, tmp_path / "profile")
    assert str(raised.value).split("\nerror: ") == [
        f"{overrides}: set-resources pretrain: no rule of that name runs a job (the pretraining phases' rule is "
        "pretrain_phase)",
        f"{overrides}: set-threads tokenise: no rule of that name runs a job"]
    assert not (tmp_path / "profile").exists()


def test_profile_check_on_the_test_cluster_rejects_a_runtime_over_its_partitions_max_time(cluster, tmp_path):
    # A partition of its own with a MaxTime (the test cluster's are unlimited), gone after the test.
    partition = f"maxtime{os.getpid()}"
    subprocess.run(["scontrol", "create", f"PartitionName={partition}", "Nodes=node1", "MaxTime=60", "State=UP"],
                   check=True)
    try:
        (tmp_path / "site.yaml").write_text(yaml.safe_dump(merge(
            yaml.safe_load((REPO / "tests" / "slurm" / "profile.yaml").read_text()),
            {"slurm-qos": "normal", "set-resources": {"pretrain_phase": {"slurm_partition": partition, "runtime": 61}}})))
        derive(REPO / "profiles" / "slurm", tmp_path / "site.yaml", tmp_path / "site")
        result = subprocess.run([sys.executable, "-m", "workflow.slurm.profile", "check", str(tmp_path / "site")],
                                cwd=REPO, capture_output=True, text=True, env=clean_env())
    finally:
        subprocess.run(["scontrol", "delete", f"PartitionName={partition}"], check=True)
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"error: {tmp_path / 'site' / 'config.v8+.yaml'}: set-resources pretrain_phase: runtime 61 min exceeds the MaxTime "
        f"of partition {partition} (60 min): set a runtime within it (a training job requeues itself and resumes)"]


def test_cluster_check_runs_the_real_phase1_trainer_on_two_nodes_and_checks_packed_against_unpacked(demo_data,
                                                                                                      new_run):
    run = new_run("cluster_check")
    copy_data(demo_data, run)
    result = run.snakemake("cluster_check")  # sample/config.yaml: the tiny model, the demo's phase-1 data
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((run.path / "results" / "cluster_check.json").read_text())
    assert report["world_size"] == 4  # tests/slurm/profile.yaml: 2 nodes x gpu:2
    hosts = {}
    for rank in report["ranks"]:  # every rank sees its node's GPUs and trains on its local rank's
        assert rank["cuda_visible_devices"] == "0,1" and rank["slurm_step_gpus"] == "0,1", rank
        hosts.setdefault(rank["host"], []).append(rank["trains_on_gpu"])
    assert len(hosts) == 2 and all(sorted(gpus) == [0, 1] for gpus in hosts.values()), report["ranks"]
    # 20 steps, or the phase's total_steps when fewer (tests/slurm/config.yaml: 12)
    assert report["steps"] == 12 and "lamb" in report["optimizer"].lower(), report
    assert report["allreduce_bus_gbps"] > 0 and report["sequences_per_second"] > 0
    assert report["checkpoint_bytes"] > 0 and report["checkpoint_write_s"] > 0
    agreement = report["packed_vs_unpacked"]
    assert len(agreement) == 4 and all(a["packed"] and a["relative_difference"] <= 1e-4 for a in agreement), agreement
    # every rank checked its fast paths against their references first (on these CPUs: unpadded attention and more)
    checked = [(r["rank"], "unpadded attention" in r["paths"]) for r in report["fast_paths"]]
    assert checked == [(rank, True) for rank in range(4)], report["fast_paths"]
    assert not (run.path / "runs" / "cluster_check").exists()  # its scratch run is gone
    (job,) = [job for job in run.jobs() if job["rule"] == "cluster_check"]
    assert "--ntasks-per-node=2" in job["SubmitLine"] and "gres/gpu=4" in job["AllocTRES"], job


def test_a_gpu_job_launched_with_fewer_ranks_than_gpus_stops_with_one_error_line(cluster, tmp_path):
    # The batch step of a 1-task job on 2 GPUs, and a plugin-style `srun -n1` wrap of a 2-task job on 2 GPUs.
    launcher = f"{sys.executable} -m workflow.slurm.launch -- true"
    outputs = []
    for name, layout, command in (("batch", ["--ntasks=1"], launcher),
                                  ("wrapped", ["--ntasks-per-node=2"], f"srun -n1 {launcher}")):
        out = tmp_path / f"{name}.out"
        result = subprocess.run(["timeout", "300", "sbatch", "--wait", "-p", "gpu", "--gres=gpu:2", "--mem=500",
                                 *layout, "-t", "5", "-o", str(out), "--wrap", command],
                                cwd=REPO, env=clean_env(), capture_output=True, text=True)
        assert result.returncode != 0, out.read_text()
        outputs.append([line for line in out.read_text().splitlines() if not line.startswith("srun: ")])
    for lines in outputs:  # (srun adds its own "srun: error: ... task 0: Exited with exit code 1")
        assert len(lines) == 1 and lines[0].startswith("error: Slurm job "), lines
        assert "on 2 GPU(s)" in lines[0] and "tasks_per_node" in lines[0] and "mpi" in lines[0], lines


@pytest.mark.parametrize("scontrol", ["on PATH", "not installed"])
def test_every_run_keeps_its_log_and_a_history_line_with_its_exit_status_and_decision(tmp_path, scontrol):
    # A run stopped by the time-limit signal after a new checkpoint asks to be requeued; outside a real job
    # `scontrol requeue` fails, which is reported on one `error:` line and ends the run with the trainer's status.
    # So does a missing scontrol (a container without Slurm's commands): the trainer's status is never lost.
    (tmp_path / "logs").mkdir()
    env = clean_env()
    if scontrol == "not installed":
        (tmp_path / "bin").mkdir()
        for command in ("sh", "mkdir", "touch"):  # the trainer's, and no Slurm command
            (tmp_path / "bin" / command).symlink_to(shutil.which(command))
        env["PATH"] = str(tmp_path / "bin")
    checkpoints = tmp_path / "run" / "checkpoints"
    script = ("import sys; from workflow.cli import configure_logging; from workflow.slurm.attempts import "
              "run_attempt; from workflow.slurm.launch import SlurmJob; configure_logging(); "
              "job = SlurmJob.parse(sys.argv[1]); run_attempt(job, ['sh', '-c', sys.argv[2], 'trainer'], {}, sys.argv[3])")
    trainer = f"echo training >&2; mkdir -p {checkpoints}; touch {checkpoints}/step_00000008.pt; exit 138"
    job = SCONTROL_2x4.replace("JobId=812", "JobId=999999999")
    with open(tmp_path / "logs" / "pretrain.log", "w") as log:
        result = subprocess.run([sys.executable, "-c", script, job, trainer, str(tmp_path / "run")], cwd=REPO,
                                stderr=log, env=env)
    assert result.returncode == 138
    kept = tmp_path / "logs" / "attempts" / "pretrain.job999999999.run0.log"
    assert kept.read_text() == (tmp_path / "logs" / "pretrain.log").read_text()  # the same file, hard-linked
    lines = kept.read_text().splitlines()
    logged = [re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", "", line) for line in lines]  # LOG_FORMAT's time
    assert logged[0].startswith("INFO workflow.slurm.attempts: Slurm job 999999999 run 0 (rule pretrain_phase), 8 rank(s) "
                                "on 2 node(s), newest checkpoint step None: sh -c"), lines
    assert lines[1] == "training"
    assert logged[2] == ("INFO workflow.slurm.attempts: Slurm job 999999999 run 0 stopped by the time-limit signal at "
                         "checkpoint step 8: requeued")
    assert lines[3].startswith("error: `scontrol requeue 999999999` failed (") and len(lines) == 4, lines
    history = json.loads((tmp_path / "logs" / "attempts" / "pretrain.history.jsonl").read_text())
    assert history == {"job": "999999999", "run": 0, "run_id": "3f1c-run", "start_step": None, "end_step": 8,
                       "exit": 138, "cause": "time-limit", "requeue": True}
