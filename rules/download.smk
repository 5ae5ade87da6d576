# Stage 1: download the Wikipedia dump (each part its own job: resumable, checksum-verified) and, optionally, BookCorpus.


include: "functions/download.smk"


rule download_wikipedia:
    output:
        "data/download/wikipedia/{part}.xml.bz2",
    params:
        url=wikipedia_part_url,
        checksum_url=wikipedia_part_checksum_url,
    log:
        "logs/download_wikipedia/{part}.log",
    resources:
        # one connection per job: `--resources download_connections=N` caps the connections to the dump site
        download_connections=1,
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.download dump --url {params.url:q} --checksum-url={params.checksum_url:q}"
        " --output {output:q} 2> {log}"


# The day the dump was taken, which every part's {{CURRENTYEAR}} and the like are filled from (never the clock):
# recorded again whenever the dump is downloaded again (a `latest` dump may then be a newer one).
rule wikipedia_dump_date:
    input:
        first_wikipedia_part,
    output:
        "data/download/wikipedia/dump_date.txt",
    params:
        url=wikipedia_url,
        checksum_url=first_wikipedia_part_checksum_url,
        date=wikipedia_date,
    log:
        "logs/wikipedia_dump_date/dump_date.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.download date --url {params.url:q} --checksum-url={params.checksum_url:q}"
        " --date={params.date:q} --output {output:q} 2> {log}"


rule download_bookcorpus:
    output:
        directory("data/download/bookcorpus"),
    params:
        source=config["bookcorpus"]["source"] or "",
    log:
        "logs/download_bookcorpus/bookcorpus.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.download books --source={params.source:q} --output {output:q} 2> {log}"
