# Input and params functions of rules/download.smk (functions apart from rules, as `snakemake --lint` asks).


def wikipedia_part_url(wildcards):
    return wikipedia_dump_parts()[wildcards.part].url


def wikipedia_part_checksum_url(wildcards):
    """The checksum list a part is verified against ("" = the list beside the dump, if any)."""
    return wikipedia_dump_parts()[wildcards.part].checksum_url


def first_wikipedia_part(wildcards):
    """The dump's first part as downloaded: its date is recorded for the dump it belongs to."""
    return f"data/download/wikipedia/{next(iter(wikipedia_dump_parts()))}.xml.bz2"


def first_wikipedia_part_checksum_url(wildcards):
    """The checksum list the parts are verified against ("" = the list beside the dump): a `latest` dump's date."""
    return next(iter(wikipedia_dump_parts().values())).checksum_url


def wikipedia_url(wildcards):
    return config["wikipedia"]["url"] or wikipedia_dump_url(config["wikipedia"]["language"])


def wikipedia_date(wildcards):
    """wikipedia.date ("" = the dump's own). A dump neither its name nor the key dates (a `latest` one is dated by its
    checksum list, in the job) stops the plan in one line."""
    from workflow.data.download import date_without_listing

    try:
        date_without_listing(wikipedia_url(wildcards), config["wikipedia"]["date"])
    except UserError as error:
        sys.exit(f"error: {error}")  # one line: an input function's exception would print a traceback
    return config["wikipedia"]["date"] or ""
