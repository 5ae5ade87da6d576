# Input and params functions of rules/scaling.smk (functions apart from rules, as `snakemake --lint` asks).


def scaling_layout(wildcards):
    """(nodes, GPUs per node) of a scaling layout name NxG."""
    nodes, gpus = wildcards.layout.split("x")
    return int(nodes), int(gpus)


def scaling_nodes(wildcards):
    return scaling_layout(wildcards)[0]


def scaling_gres(wildcards):
    return f"gpu:{scaling_layout(wildcards)[1]}"


def scaling_threads(wildcards):
    """The job's CPU threads: two per rank (the trainer gives each local rank its share)."""
    return 2 * scaling_layout(wildcards)[1]


def scaling_data(wildcards):
    return hdf5_dir(wildcards.phase)


def scaling_results():
    """Each configured phase's benchmark of each configured layout (config scaling)."""
    layouts = [f"{layout['nodes']}x{layout['gpus_per_node']}" for layout in config["scaling"]["layouts"]]
    return expand("results/scaling/{phase}/{layout}.json", phase=config["scaling"]["phases"], layout=layouts)
