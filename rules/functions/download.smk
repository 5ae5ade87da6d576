# Input and params functions of rules/download.smk (functions apart from rules, as `snakemake --lint` asks).


def wikipedia_part_url(wildcards):
    return wikipedia_dump_parts()[wildcards.part].url


def wikipedia_part_checksum_url(wildcards):
    """The checksum list a part is verified against ("" = the list beside the dump, if any)."""
    return wikipedia_dump_parts()[wildcards.part].checksum_url
