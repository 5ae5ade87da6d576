"""benchmarks/full_dump_projection.py's schedule: jobs wait for their inputs and share a node's cores as Snakemake,
its Slurm plugin and Slurm do, so the projected wall time is what the DAG, the profile's groups and the plugin's
status polling allow, not a sum of stages nor perfect spreading."""
from pathlib import Path

from benchmarks.full_dump_projection import rule_threads
from benchmarks.slurm_schedule import Policy, policy_from_profile, schedule, slurm_jobs

REPO = Path(__file__).resolve().parents[1]
NO_POLLING = Policy(groups={}, components={}, group_cores=64, first_check_s=0.0, submit_s=0.0)


def job(stage, seconds, threads=1, deps=(), rule=None, local=False):
    return dict(stage=stage, rule=rule or stage, seconds=seconds, threads=threads, deps=list(deps), local=local)


def test_a_job_waits_for_all_its_inputs_and_independent_jobs_share_the_cores():
    # two 10 s parts, then a job that needs both, beside a 4 s job that needs only the first part
    jobs = [job("part", 10), job("part", 10), job("merge", 5, deps=[0, 1]), job("follow", 4, deps=[0])]
    assert schedule(jobs, 1, 2, NO_POLLING) == {"part": (0, 10), "follow": (10, 14), "merge": (10, 15)}
    # one core: pending jobs start in submission order: the follower (submitted at 10) before the merge (at 20)
    assert schedule(jobs, 1, 1, NO_POLLING) == {"part": (0, 20), "follow": (20, 24), "merge": (24, 29)}


def test_a_job_takes_its_threads_on_one_node_capped_at_a_node():
    jobs = [job("wide", 10, threads=3), job("wide", 10, threads=3), job("narrow", 1)]
    # 4 cores: one wide job at a time, the narrow one beside the first
    assert schedule(jobs, 1, 4, NO_POLLING) == {"wide": (0, 20), "narrow": (0, 1)}
    # two nodes of 4 cores: both wide jobs at once; a job wider than a node gets the whole node
    assert schedule(jobs, 2, 4, NO_POLLING) == {"wide": (0, 10), "narrow": (0, 1)}
    assert schedule([job("huge", 7, threads=64)], 1, 8, NO_POLLING) == {"huge": (0, 7)}


def test_threads_are_read_from_the_rules():
    assert rule_threads("tokenize") == 1
    assert rule_threads("vocab") >= 2  # of the trained vocab's branch, not the copied one's


def test_a_dependent_waits_for_the_plugins_next_status_check_whose_interval_grows_while_nothing_ends():
    polling = Policy(groups={}, components={}, group_cores=8, first_check_s=10.0, submit_s=1.0)
    # checks at 10, 30, 60, 100 (+10 s each while nothing ended): the 75 s job (1..76) is seen at 100
    jobs = [job("long", 75), job("next", 5, deps=[0])]
    assert schedule(jobs, 1, 4, polling) == {"long": (1, 76), "next": (101, 106)}
    # a check that saw an end resets the interval: "short" (1..6) seen at 10, "after_short" (11..12) at 20, then
    # checks at 30, 50, 80: "long" (1..76) seen at 80
    jobs = [job("short", 5), job("long", 75), job("after_short", 1, deps=[0]), job("after_long", 1, deps=[1])]
    assert schedule(jobs, 1, 4, polling) == {"short": (1, 6), "long": (1, 76), "after_short": (11, 12),
                                             "after_long": (81, 82)}


def test_a_local_job_runs_at_once_and_its_dependents_are_submitted_when_it_ends():
    polling = Policy(groups={}, components={}, group_cores=8, first_check_s=10.0, submit_s=1.0)
    jobs = [job("slurm", 5), job("copy", 2, deps=[0], local=True), job("then", 3, deps=[1])]
    # slurm 1..6 seen at 10; the copy 10..12 on the submit host; "then" submitted at 12, pending 13
    assert schedule(jobs, 1, 1, polling) == {"slurm": (1, 6), "copy": (10, 12), "then": (13, 16)}


def test_grouped_jobs_run_in_one_slurm_job_per_components_without_waiting_for_a_check():
    polling = Policy(groups={"tok": "shard", "enc": "shard"}, components={"shard": 2}, group_cores=4,
                     first_check_s=10.0, submit_s=1.0)
    # 3 shards: tokenize (2 threads) -> encode each; two shards per Slurm job (connected tok+enc = one component)
    jobs = [job("tok", 2, threads=2), job("tok", 2, threads=2), job("tok", 3, threads=2), job("enc", 4, deps=[0]),
            job("enc", 4, deps=[1]), job("enc", 1, deps=[2])]
    units = slurm_jobs(jobs, polling)
    # a job asks for its widest level, capped at `cores`: 2 + 2 tokenizes (4), then 1 + 1 encodes; 2, then 1
    assert [(u["members"], u["cores"], u["deps"]) for u in units] == [([0, 1, 3, 4], 4, []), ([2, 5], 2, [])]
    # inside a job an encode follows its tokenize at once; the two Slurm jobs run side by side on 6 cores
    assert schedule(jobs, 1, 6, polling) == {"tok": (1, 4), "enc": (3, 7)}
    # a job holds its cores until its last member ends: on 4 cores the second waits for the first (1..7)
    assert schedule(jobs, 1, 4, polling)["enc"] == (3, 11)


def test_a_chain_in_one_slurm_job_asks_for_its_widest_link_not_their_sum():
    policy = Policy(groups={"extract": "x", "format": "x"}, components={"x": 1}, group_cores=32, first_check_s=0.0,
                    submit_s=0.0)
    jobs = [job("extract", 10, threads=16), job("format", 2, threads=4, deps=[0])]
    assert [u["cores"] for u in slurm_jobs(jobs, policy)] == [16]
    assert schedule(jobs + jobs[:1] + [job("format", 2, threads=4, deps=[2])], 1, 32, policy) == {
        "extract": (0, 10), "format": (10, 12)}  # two such jobs side by side on 32 cores


def test_the_policy_is_the_slurm_profiles():
    policy = policy_from_profile(REPO / "profiles" / "slurm" / "config.v8+.yaml", submit_s=2.0)
    assert policy.groups["tokenize"] == policy.groups["encode"] and policy.components[policy.groups["encode"]] > 1
    assert policy.first_check_s == 5.0 and policy.group_cores == 32
