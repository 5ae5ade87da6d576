"""benchmarks/full_dump_projection.py's schedule: jobs wait for their inputs and share a node's cores as Snakemake's
scheduler does, so the projected wall time is what the DAG allows, not a sum of stages nor perfect spreading."""
from benchmarks.full_dump_projection import rule_threads, schedule


def job(stage, seconds, threads=1, deps=()):
    return dict(stage=stage, name=stage, seconds=seconds, threads=threads, deps=list(deps))


def test_a_job_waits_for_all_its_inputs_and_independent_jobs_share_the_cores():
    # two 10 s parts, then a job that needs both, beside a 4 s job that needs only the first part
    jobs = [job("part", 10), job("part", 10), job("merge", 5, deps=[0, 1]), job("follow", 4, deps=[0])]
    assert schedule(jobs, nodes=1, cores=2) == {"part": (0, 10), "follow": (10, 14), "merge": (10, 15)}
    # one core: jobs in DAG order as they become ready, so the merge (listed first) before the follower
    assert schedule(jobs, nodes=1, cores=1) == {"part": (0, 20), "merge": (20, 25), "follow": (25, 29)}


def test_a_job_takes_its_threads_on_one_node_capped_at_a_node():
    jobs = [job("wide", 10, threads=3), job("wide", 10, threads=3), job("narrow", 1)]
    # 4 cores: one wide job at a time, the narrow one beside the first
    assert schedule(jobs, nodes=1, cores=4) == {"wide": (0, 20), "narrow": (0, 1)}
    # two nodes of 4 cores: both wide jobs at once; a job wider than a node gets the whole node
    assert schedule(jobs, nodes=2, cores=4) == {"wide": (0, 10), "narrow": (0, 1)}
    assert schedule([job("huge", 7, threads=64)], nodes=1, cores=8) == {"huge": (0, 7)}


def test_threads_are_read_from_the_rules():
    assert rule_threads("tokenize") == 1
    assert rule_threads("vocab") >= 2  # of the trained vocab's branch, not the copied one's


def test_a_delayed_job_waits_after_its_inputs_without_holding_cores():
    jobs = [job("part", 10), dict(job("slurm", 5, deps=[0]), delay=30), job("beside", 20, deps=[0])]
    # one core: the delayed job's gap (10..40) leaves the core to the job beside it (10..30)
    assert schedule(jobs, nodes=1, cores=1) == {"part": (0, 10), "beside": (10, 30), "slurm": (40, 45)}
