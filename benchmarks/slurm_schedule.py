"""The schedule that Snakemake, snakemake-executor-plugin-slurm 2.8.0 and Slurm make of a DAG of jobs on N nodes x C
cores (for benchmarks/full_dump_projection.py). Jobs are dicts: stage, rule, seconds, threads, deps (indices of
earlier jobs), local (a `localrules` job: optional).

- Slurm jobs, as profiles/slurm asks: the connected jobs of one `groups` group, `group-components` of those
  components per Slurm job (in DAG order), run inside it on min(`cores`, the threads of its widest toposort level:
  Snakemake's layered group resources) CPUs as their inputs are done, with no wait between them; a job of no group is a Slurm job of its own; a local job runs
  on the submit host.
- Polling (the plugin's check_active_jobs): Snakemake learns that a Slurm job ended only at the plugin's next
  status check. The first comes `slurm-init-seconds-before-status-checks` after a submission to an idle queue;
  the interval resets to that after a check that saw a job end and otherwise grows by 10 s, to 180 s at most (0:
  no polling, each end known at once). A job
  whose inputs are then known to be done is submitted, and is pending `submit_s` later (sbatch and Slurm's
  scheduler: an assumption); once started, its members begin `job_overhead_s` later (the Snakemake jobstep that
  runs them starting up: benchmarks/slurm_polling.py measures it). A local job's end is known at once.
- Slurm: a pending job starts on the first node with its cores free, earlier submissions first, a later one beside
  them when it fits (backfill).
"""
import heapq
from dataclasses import dataclass
from pathlib import Path

import yaml

MAX_INTERVAL_S, GROWTH_S = 180.0, 10.0  # hard-coded in the plugin (2.8.0)


@dataclass(frozen=True)
class Policy:
    groups: dict  # rule -> group
    components: dict  # group -> members per Slurm job
    group_cores: int
    first_check_s: float
    submit_s: float
    job_overhead_s: float = 0.0  # a Slurm job's own start inside its allocation (the jobstep's Snakemake, prolog)


def policy_from_profile(profile: Path, submit_s: float, group_cores: int | None = None,
                        job_overhead_s: float = 0.0) -> Policy:
    """The grouping and polling of a Snakemake profile (profiles/slurm/config.v8+.yaml)."""
    settings = yaml.safe_load(profile.read_text())
    return Policy(groups=settings.get("groups", {}), components=settings.get("group-components", {}),
                  group_cores=group_cores or settings.get("cores", 1),
                  first_check_s=float(settings.get("slurm-init-seconds-before-status-checks", 40)),
                  submit_s=submit_s, job_overhead_s=job_overhead_s)


def slurm_jobs(jobs: list[dict], policy: Policy) -> list[dict]:
    """The Slurm jobs (units) the jobs are submitted as: members, cores, the units they wait for, local or not."""
    root = list(range(len(jobs)))

    def find(index):
        while root[index] != index:
            root[index] = root[root[index]]
            index = root[index]
        return index

    group = [policy.groups.get(job["rule"]) for job in jobs]
    for index, job in enumerate(jobs):
        for dep in job["deps"]:
            if group[index] is not None and group[dep] == group[index]:
                root[find(index)] = find(dep)
    components: dict[int, list[int]] = {}
    for index in range(len(jobs)):
        components.setdefault(find(index), []).append(index)
    units, packing = [], {}
    for members in sorted(components.values()):
        name = group[members[0]]
        if name is None:
            units.append(members)
            continue
        open_unit = packing.get(name)
        if open_unit is None or open_unit[1] >= policy.components.get(name, 1):
            open_unit = packing[name] = [[], 0]
            units.append(open_unit[0])
        open_unit[0].extend(members)
        open_unit[1] += 1
    unit_of = {member: number for number, members in enumerate(units) for member in members}
    result = []
    for number, members in enumerate(units):
        members = sorted(members)
        cores = min(policy.group_cores, widest_level(jobs, members)) if group[members[0]] is not None \
            else jobs[members[0]]["threads"]
        deps = {unit_of[dep] for m in members for dep in jobs[m]["deps"]} - {number}
        result.append(dict(members=members, cores=cores, deps=sorted(deps),
                           local=all(jobs[m].get("local", False) for m in members)))
    return result


def widest_level(jobs: list[dict], members: list[int]) -> int:
    """The CPUs Snakemake asks for a group job: the threads of its widest toposort level (members whose inputs
    among the members are at the same depth run side by side; a chain asks for its widest link, not the sum)."""
    level: dict[int, int] = {}
    for member in sorted(members):  # deps have lower indices
        level[member] = 1 + max((level[dep] for dep in jobs[member]["deps"] if dep in level), default=-1)
    widths: dict[int, int] = {}
    for member, depth in level.items():
        widths[depth] = widths.get(depth, 0) + jobs[member]["threads"]
    return max(widths.values())


def list_schedule(jobs: list[dict], members: list[int], cores: int) -> dict[int, tuple[float, float]]:
    """(start, end) of `members` run inside one Slurm job of `cores` CPUs, each as soon as its inputs among them are
    done and its threads (capped at `cores`) are free, in DAG order."""
    inside = set(members)
    done: dict[int, float] = {}
    times: dict[int, tuple[float, float]] = {}
    running: list[tuple[float, int]] = []
    free, now, waiting = cores, 0.0, list(members)
    while waiting or running:
        for member in list(waiting):
            need = min(jobs[member]["threads"], cores)
            if need <= free and all(dep in done for dep in jobs[member]["deps"] if dep in inside):
                free -= need
                times[member] = (now, now + jobs[member]["seconds"])
                heapq.heappush(running, (now + jobs[member]["seconds"], member))
                waiting.remove(member)
        now, member = heapq.heappop(running)
        free += min(jobs[member]["threads"], cores)
        done[member] = now
    return times


def schedule(jobs: list[dict], nodes: int, cores: int, policy: Policy) -> dict[str, tuple[float, float]]:
    """Each stage's (first start, last end) when the jobs run as Slurm jobs on `nodes` x `cores`."""
    units = slurm_jobs(jobs, policy)
    for unit in units:
        unit["need"] = min(unit["cores"], cores)
        unit["times"] = list_schedule(jobs, unit["members"], unit["need"])
        if not unit["local"]:  # the members start after the job's own start inside its allocation
            unit["times"] = {m: (a + policy.job_overhead_s, b + policy.job_overhead_s) for m, (a, b) in unit["times"].items()}
        unit["seconds"] = max(end for _, end in unit["times"].values())
    waiting = [len(unit["deps"]) for unit in units]
    dependents = [[] for _ in units]
    for number, unit in enumerate(units):
        for dep in unit["deps"]:
            dependents[dep].append(number)
    free = [cores] * nodes
    pending: list[tuple[float, int]] = []  # (pending from, unit): submitted to Slurm
    running: list[tuple[float, int, int]] = []  # (end, unit, node; -1: the submit host)
    ended: list[int] = []  # Slurm jobs ended, not yet seen by a status check
    starts: dict[int, float] = {}
    now, interval, next_check, active = 0.0, policy.first_check_s, None, 0

    def submit(number: int) -> None:
        nonlocal interval, next_check, active
        if units[number]["local"]:
            starts[number] = now
            heapq.heappush(running, (now + units[number]["seconds"], number, -1))
            return
        if active == 0:  # an idle queue: the first check comes the initial delay after this submission
            interval, next_check = policy.first_check_s, now + policy.first_check_s
        active += 1
        heapq.heappush(pending, (now + policy.submit_s, number))

    def notice(number: int) -> None:
        for other in dependents[number]:
            waiting[other] -= 1
            if waiting[other] == 0:
                submit(other)

    for number in range(len(units)):
        if waiting[number] == 0:
            submit(number)
    while pending or running or ended:
        held = []
        while pending and pending[0][0] <= now:  # Slurm: in submission order, each where it fits
            entry = heapq.heappop(pending)
            node = next((n for n in range(nodes) if free[n] >= units[entry[1]]["need"]), None)
            if node is None:
                held.append(entry)
                continue
            free[node] -= units[entry[1]]["need"]
            starts[entry[1]] = now
            heapq.heappush(running, (now + units[entry[1]]["seconds"], entry[1], node))
        for entry in held:
            heapq.heappush(pending, entry)
        upcoming = [t for t in (running[0][0] if running else None, next_check if active else None,
                                next((t for t, _ in sorted(pending) if t > now), None)) if t is not None]
        now = min(upcoming)
        if running and running[0][0] == now:
            _, number, node = heapq.heappop(running)
            if node >= 0:
                free[node] += units[number]["need"]
            if node >= 0 and policy.first_check_s > 0:
                ended.append(number)
                continue
            active -= node >= 0  # a local job, or no polling (first_check_s 0): its end is known at once
            notice(number)
        elif active and next_check == now:
            if ended:
                active -= len(ended)
                seen, ended[:] = list(ended), []
                interval = policy.first_check_s
                for number in seen:
                    notice(number)
            else:
                interval = min(interval + GROWTH_S, MAX_INTERVAL_S)
            next_check = now + interval
    spans: dict[str, tuple[float, float]] = {}
    for number, unit in enumerate(units):
        for member, (start, end) in unit["times"].items():
            stage = jobs[member]["stage"]
            first, last = spans.get(stage, (float("inf"), 0.0))
            spans[stage] = (min(first, starts[number] + start), max(last, starts[number] + end))
    return spans
