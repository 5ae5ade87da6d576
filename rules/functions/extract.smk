# Input and params functions of rules/extract.smk (functions apart from rules, as `snakemake --lint` asks).


def all_template_pages(wildcards):
    """The template pages of every part: each part is extracted with all of them, as in the whole dump."""
    return wikipedia_parts("data/extracted/wikipedia/{part}.templates.xml")
