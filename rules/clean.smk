# Optional: `snakemake clean_intermediates` frees the disk the data half's intermediates hold once the training
# data exists (building it first if needed). Snakemake does not rebuild an up-to-date output whose inputs are
# gone, so the HDF5 directories stay done; a later change upstream of them regenerates what it needs.
# Kept: the downloads, the vocab, the HDF5 directories and data/encoded_seq* (their files are hard links of them).
INTERMEDIATES = ["data/extracted", "data/formatted", "data/punkt", "data/shards", "data/tokenized"]


rule clean_intermediates:
    input:
        [hdf5_dir(phase) for phase in PHASES],
        VOCAB,
        "results/corpora.csv",  # counted from the shards and their tokens: before they go
    params:
        paths=INTERMEDIATES,
    log:
        "logs/clean_intermediates.log",
    conda:
        "../envs/data.yaml"
    shell:
        "rm -rf {params.paths} 2> {log}"
