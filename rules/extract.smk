# Stage 2: wikiextractor, articles only, into JSON lines {id, title, text}; one job per part of the dump.
# Templates are expanded with the template pages of every part (collected per part, compiled once into the file
# every extract job loads), as in the whole dump.


include: "functions/extract.smk"


rule wikipedia_templates:
    input:
        "data/download/wikipedia/{part}.xml.bz2",
    output:
        "data/extracted/wikipedia/{part}.templates.xml",
    threads: 4  # bz2 decompression (block-parallel): the scan itself is a byte search
    log:
        "logs/wikipedia_templates/{part}.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.template_pages --input {input:q} --output {output:q} --threads {threads} 2> {log}"


rule compile_templates:
    input:
        all_template_pages,
    output:
        "data/extracted/wikipedia/templates.bin",
    threads: 16  # the parts' template pages parsed at once; every extract job waits for this one
    log:
        "logs/compile_templates/templates.log",
    conda:
        "../envs/data.yaml"
    shell:
        "python -m workflow.data.templates --input {input:q} --output {output:q} --processes {threads} 2> {log}"


rule extract_wikipedia:
    input:
        dump="data/download/wikipedia/{part}.xml.bz2",
        templates="data/extracted/wikipedia/templates.bin",
        date="data/download/wikipedia/dump_date.txt",  # one date for every part: a new one re-extracts them
    output:
        "data/extracted/wikipedia/{part}.jsonl",
    # wikiextractor's processes: its one reader (bz2 + page parsing) feeds ~14 PyPy workers; more would wait for it
    # (benchmarks/full_dump_projection.py: 14 projects 0.013 h less on one 128-core node than 16, 9 jobs at once)
    threads: 14
    log:
        "logs/extract_wikipedia/{part}.log",
    conda:
        "../envs/extract.yaml"  # PyPy: ~1.3x less CPU than CPython, the same JSON
    shell:
        "python -m workflow.data.extract --input {input.dump:q} --output {output:q} --processes {threads}"
        " --templates {input.templates:q} --date-file {input.date:q} 2> {log}"
