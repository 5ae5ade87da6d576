# Input functions of rules/cluster_check.smk (functions apart from rules, as `snakemake --lint` asks).

SYNTHETIC_CHECK_DATA = "data/cluster_check_synthetic"


def cluster_check_data(wildcards):
    """What cluster_check trains on: the phase-1 data and vocab, or (cluster_check.data: synthetic) their stand-ins."""
    if config["cluster_check"]["data"] == "synthetic":
        return {"data": f"{SYNTHETIC_CHECK_DATA}/hdf5",
                "vocab": f"{SYNTHETIC_CHECK_DATA}/vocab.txt"}
    return {"data": hdf5_dir(PHASES[0]), "vocab": VOCAB}


def given_vocab(wildcards):
    """vocab.file when the config names one (the synthetic data's vocab), else nothing."""
    return [config["vocab"]["file"]] if config["vocab"]["file"] else []
