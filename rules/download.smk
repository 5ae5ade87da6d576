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
