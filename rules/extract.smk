# Stage 2: wikiextractor, articles only, into JSON lines {id, title, text}.


rule extract_wikipedia:
    input:
        "data/download/wikipedia.xml.bz2",
    output:
        "data/extracted/wikipedia.jsonl",
    threads: 4
    log:
        "logs/extract_wikipedia/wikipedia.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.extract --input {input:q} --output {output:q} --processes {threads} 2> {log}"
