# Stage 1: download the Wikipedia dump (resumable, checksum-verified) and, optionally, BookCorpus.


rule download_wikipedia:
    output:
        "data/download/wikipedia.xml.bz2",
    params:
        url=config["wikipedia"]["url"],
        checksum_url=config["wikipedia"]["checksum_url"] or "",
    log:
        "logs/download_wikipedia/wikipedia.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.download file --url {params.url:q} --checksum-url={params.checksum_url:q}"
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
