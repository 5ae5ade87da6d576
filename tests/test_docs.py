"""Every command in README.md and docs/*.md runs as written, every config snippet is valid, every link resolves.

Commands come from the pages' ```bash blocks and from inline code that starts with `snakemake `, `python `
or `make `. Each is checked in a scratch copy of the workflow (tests/conftest.py copy_workflow), as follows:
- `snakemake ...`: run as written plus `-n` (a dry run), on the demo's `sample/config.yaml` unless the command
  names a config file; a YAML config snippet in the same paragraph (e.g. `model: {preset: bert-base}`) is added
  when it names no path. The run must plan (exit 0). `--report FILE` needs a finished run: the same command
  without it is dry-run, and `--report` must be a Snakemake option. Conda is not installed here, so the copy's
  stock Slurm profile is used without `software-deployment-method` (the pages' "Without conda" way).
- `python -m workflow.slurm.profile derive ...` runs for real (the profile the other commands use), on the
  pages' own `my-cluster.yaml` block; `python sample/...py` runs for real and must rewrite the sample byte for
  byte.
- any other `python -m MODULE ...` or `python SCRIPT ...`: parsed only (it needs data, a GPU or Slurm): every
  `--option` of the command must be in the `--help` of its module (or of its subcommand).
- `make TARGET`: `make -n TARGET` in the checkout (prints, runs nothing).
- `python -c CODE`: compiled only. A command after `VAR=value` words is checked as the command itself.
- other tools (`sacct`, `less`, `rm`, `sudo`, ...): parsed only: the tool is one the pages may name, and every
  path into the repository's sources exists.
A block or paragraph after `<!-- pending: NAME -->` documents a feature another branch adds: skipped, naming it.
"""
import gzip
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, copy_workflow, snakemake_env
from workflow.config import validate_config
from workflow.slurm.profile import PROFILE_FILE, merge

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCHEMA = yaml.safe_load((REPO / "config.schema.yaml").read_text())["properties"]
SCHEMA_SECTIONS = set(SCHEMA)
SCALAR_SECTIONS = {name for name, section in SCHEMA.items() if section.get("type") != "object"}  # seed
PENDING = re.compile(r"<!-- pending: ([\w-]+)")
# Tools a page may name besides snakemake, python and make: the cluster's, the shell's, the system's.
TOOLS = {"sacct", "sacctmgr", "scontrol", "sinfo", "squeue", "scancel", "srun", "sbatch", "less", "ls", "rm", "sudo",
         "tensorboard", "apt", "apt-get", "pip", "tmux", "screen", "md5sum", "mkdir", "cp", "tests/slurm/start_cluster.sh",
         "cd", "source", "wget", "ln", "zcat", "bash"}
ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=\S*$")  # `CUDA_VISIBLE_DEVICES=0,1 snakemake ...`: the command after it
# The user's own files that the pages' examples name (a released model, a DLE checkpoint): the dry runs get stand-ins.
USER_FILES = ("models/bert-base-uncased/vocab.txt", "models/bert-base-cased/vocab.txt", "checkpoints/ckpt_8601.pt",
              "bert_configs/large.json", "vocab/vocab.txt")
CLONE = "~/snakebert"  # where the pages say the clone is, for runs in a directory of their own
SOURCE_DIRS = ("tests/", "workflow/", "profiles/", "sample/", "benchmarks/", "rules/", "envs/")


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    pending: str | None
    snippets: tuple = ()  # the YAML config snippets of the command's paragraph

    def __str__(self):
        return f"{self.page}:{self.line}: {self.text}"


def _paragraphs(text: str):
    """(first line number, lines, pending feature or None) per paragraph or fenced block, in page order."""
    pending, armed, block, start, fenced = None, False, [], 1, False
    for number, line in enumerate(text.splitlines() + [""], 1):
        if line.startswith("```"):
            armed = False
            block.append(line)
            if fenced:
                yield start, block, pending
                block = []
            else:
                if block[:-1]:
                    yield start, block[:-1], pending
                block, start = [line], number
            fenced = not fenced
            continue
        if fenced:
            block.append(line)
            continue
        marker = PENDING.search(line)
        if marker and line.startswith("<!--"):
            pending, armed = marker[1], True
            continue
        if armed and line.strip():  # the marked paragraph: the one right after the marker
            armed = False
        elif line.startswith(("**", "#")):  # a new recipe or section ends it
            pending = None
        if line.strip():
            if not block:
                start = number
            block.append(line)
        elif block:
            yield start, block, pending
            block = []


def _joined(lines):
    """A bash block's commands: continuation lines joined, comments and blank lines dropped."""
    commands, current = [], ""
    for line in lines:
        current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            words = shlex.split(current, comments=True)
            if words:
                commands.append(current.split(" #")[0].strip())
            current = ""
    return commands


def _config_snippets(lines) -> list[dict]:
    """Inline code and ```yaml blocks that are config snippets: YAML mappings of config sections."""
    if lines[0].startswith("```"):  # a ```yaml block is a config snippet, whatever its keys, unless it names a file
        named = len(lines) > 1 and lines[1].startswith("# ") and ".yaml" in lines[1]
        return [yaml.safe_load("\n".join(lines[1:-1]))] if lines[0] == "```yaml" and not named else []
    snippets = []
    for text in re.findall(r"`([^`]+)`", " ".join(lines)):
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        if isinstance(value, dict) and value and set(value) <= SCHEMA_SECTIONS and ":" in text \
                and all(isinstance(v, dict) or k in SCALAR_SECTIONS for k, v in value.items()):
            # not `corpora:` (names a section) or `format: text` (a corpus entry's key): they set no section
            snippets.append(value)
    return snippets


def page_items():
    """(commands, snippets, named files) of every page."""
    commands, snippets, files = [], [], {}
    for page in PAGES:
        name = str(page.relative_to(REPO))
        for start, lines, pending in _paragraphs(page.read_text()):
            found = _config_snippets(lines)
            snippets += [(f"{name}:{start}", snippet, pending) for snippet in found]
            if lines[0].startswith("```yaml") and lines[1].startswith("# ") and ".yaml" in lines[1]:
                files[lines[1][2:].split(":")[0].split()[0]] = "\n".join(lines[1:-1]) + "\n"
            if lines[0].startswith("```bash"):
                texts = _joined(lines[1:-1])
            elif lines[0].startswith("```"):
                texts = []
            else:
                texts = [t for t in re.findall(r"`([^`]+)`", " ".join(lines))
                         if re.match(r"(snakemake|python3?|make) ", t) and "<" not in t]
            commands += [Command(name, start, text, pending, tuple(s for s in found if "/" not in str(s)))
                         for text in texts]
    unique = {}  # a command repeated with the same config snippets is checked once, where it first appears
    for command in commands:
        unique.setdefault((command.text, repr(command.snippets)), command)
    return list(unique.values()), snippets, files


COMMANDS, SNIPPETS, FILES = page_items()


def _config_files_in(command: Command, workdir: Path) -> list[str]:
    files = ["sample/config.yaml"]
    for number, snippet in enumerate(command.snippets):
        path = workdir / f"snippet-{command.line}-{number}.yaml"
        path.write_text(yaml.safe_dump(snippet))
        files.append(path.name)
    return files


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A copy of the workflow with the pages' named files (my-cluster.yaml) and the profiles they derive."""
    workdir = copy_workflow(tmp_path_factory.mktemp("docs"))
    stock = workdir / "profiles" / "slurm" / PROFILE_FILE
    stock.write_text(yaml.safe_dump(merge(yaml.safe_load(stock.read_text()), {"software-deployment-method": None}),
                                    sort_keys=False))
    for name, text in FILES.items():
        (workdir / name).write_text(text)
    for path in USER_FILES:  # the user's own files the pages' examples name: stand-ins, a dry run only looks
        (workdir / path).parent.mkdir(parents=True, exist_ok=True)
        (workdir / path).write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n" if path.endswith("vocab.txt") else "")
    for command in COMMANDS:
        if command.text.startswith("python -m workflow.slurm.profile derive") and not command.pending:
            result = subprocess.run(shlex.split(command.text.replace("python", sys.executable, 1)), cwd=workdir,
                                    capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, f"{command}\n{result.stderr}"
    return workdir


def _help(argv: list[str], workdir: Path) -> str:
    result = subprocess.run([sys.executable, *argv, "--help"], cwd=workdir, capture_output=True, text=True,
                            env=snakemake_env(), timeout=120)
    assert result.returncode == 0, f"{' '.join(argv)} --help: {result.stderr[-2000:]}"
    return result.stdout


def _check_python(command: Command, words: list[str], workdir: Path) -> None:
    if words[1] == "-c":  # a one-liner on the run's files (a manifest): it must at least be Python
        compile(words[2], str(command), "exec")
        return
    if words[1] != "-m" and words[1].startswith("sample/"):  # regenerates the sample: it must come out the same
        result = subprocess.run([sys.executable, words[1]], cwd=workdir, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        changed = subprocess.run(["diff", "-r", "-q", str(REPO / "sample"), str(workdir / "sample")],
                                 capture_output=True, text=True)
        assert changed.returncode == 0, changed.stdout
        return
    target = words[1:3] if words[1] == "-m" else words[1:2]
    rest = words[len(target) + 1:]
    if target[-1] == "workflow.slurm.launch":  # `launch [--run-dir D] -- COMMAND`: its own options before `--`
        rest = rest[:rest.index("--")] if "--" in rest else rest
    options = {word.split("=")[0] for word in rest if word.startswith("--") and word != "--"}
    usage = _help(target, workdir)
    subcommands = {name for group in re.findall(r"\{([\w,-]+)\}", usage) for name in group.split(",")}
    if rest and rest[0] in subcommands:  # the subcommand's own options
        target.append(rest[0])
        usage = _help(target, workdir)
    missing = sorted(option for option in options if not re.search(rf"{re.escape(option)}(?![\w-])", usage))
    assert not missing, f"{command}: no such option(s) {missing} in `{' '.join(target)} --help`"


def _check_snakemake(command: Command, words: list[str], workdir: Path) -> None:
    args = [word.replace(CLONE, str(workdir)) for word in words[1:]]  # the clone is the scratch copy here
    if "--report" in args:
        assert "--report" in _help(["-m", "snakemake"], workdir)
        index = args.index("--report")
        del args[index:index + 2]
    if "--configfile" not in args:
        args += ["--configfile", *_config_files_in(command, workdir)]
    else:  # the page's own config file, over the demo's (later files override earlier ones)
        args.insert(args.index("--configfile") + 1, "sample/config.yaml")
    if "--lint" in args:  # reads the rules, runs nothing
        result = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workdir, capture_output=True,
                                text=True, env=snakemake_env(), timeout=300)
        assert result.returncode == 0 and "Lints for" not in result.stdout + result.stderr, result.stdout[-3000:]
        return
    result = subprocess.run([sys.executable, "-m", "snakemake", *args, "-n"], cwd=workdir, capture_output=True,
                            text=True, env=snakemake_env(), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{command}\n{output[-3000:]}"
    done = ("This was a dry-run", "Nothing to be done", "Unlocked working directory")  # --unlock runs no job
    assert any(word in output for word in done), output[-2000:]


def _check_tool(command: Command, words: list[str]) -> None:
    tool = words[1] if words[0] == "sudo" else words[0]
    assert tool in TOOLS, f"{command}: {tool} is not a tool the pages may name (tests/test_docs.py TOOLS)"
    for word in words:
        if word.startswith(SOURCE_DIRS):
            assert (REPO / word).exists(), f"{command}: {word} does not exist"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_every_command_in_the_pages_runs_as_written(command, workdir):
    if command.pending:
        pytest.skip(f"pending: {command.pending} (the feature's branch adds it; the lead adjusts it on merge)")
    words = shlex.split(command.text)
    while len(words) > 1 and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words[0] == "snakemake":
        _check_snakemake(command, words, workdir)
    elif words[0] in ("python", "python3"):
        if command.text.startswith("python -m workflow.slurm.profile derive"):
            assert (workdir / shlex.split(command.text)[-1] / PROFILE_FILE).is_file()  # derived by the fixture
        else:
            _check_python(command, words, workdir)
    elif words[0] == "make":
        result = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{command}\n{result.stderr}"
    else:
        _check_tool(command, words)


@pytest.mark.parametrize(("where", "snippet", "pending"), SNIPPETS, ids=[where for where, _, _ in SNIPPETS])
def test_every_config_snippet_in_the_pages_is_valid(where, snippet, pending):
    if pending:
        pytest.skip(f"pending: {pending} (the feature's branch adds its keys)")
    validate_config(yaml.safe_load(yaml.safe_dump(snippet)))  # raises UserError naming the key


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def links():
    for page in PAGES:
        for start, lines, pending in _paragraphs(page.read_text()):
            for line in lines:
                for target in re.findall(r"\]\(([^)\s]+)\)", line):
                    if not target.startswith(("http://", "https://")) and not (pending or PENDING.search(line)):
                        yield pytest.param(page, target, id=f"{page.relative_to(REPO)}:{start}:{target}")


@pytest.mark.parametrize(("page", "target"), list(links()))
def test_every_link_in_the_pages_resolves(page, target):
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.exists(), f"{target}: no such file"
    if anchor:
        assert anchor in _anchors(linked), f"{target}: no heading with that anchor in {linked.name}"


def test_the_checks_above_see_the_pages_commands():
    """The extraction itself: the README's own steps are among the commands checked."""
    readme = {command.text for command in COMMANDS if command.page == "README.md"}
    assert {"make demo", "make test", "snakemake --profile profiles/my-cluster all",
            "python -m workflow.slurm.profile check profiles/my-cluster"} <= readme


def test_the_readme_is_a_guide_without_test_names():
    """Test names are no user documentation (docs/design.md lists the tests behind the guarantees)."""
    assert re.findall(r"\btest_\w+", (REPO / "README.md").read_text()) == []


def _schema_has(key: str) -> bool:
    """Whether a dotted config key (`pretrain.phase1.learning_rate`, `seed`) is in config.schema.yaml."""
    schema = yaml.safe_load((REPO / "config.schema.yaml").read_text())
    node = schema
    for part in key.split("."):
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        if part not in node.get("properties", {}):
            return False
        node = node["properties"][part]
    return True


def dle_table_keys():
    """The config keys the DLE flag tables of docs/from-dle.md name (a row's second column), with the row's line."""
    for number, line in enumerate((REPO / "docs" / "from-dle.md").read_text().splitlines(), 1):
        cells = line.split(" | ")
        if line.startswith("| `--") and len(cells) >= 2:
            for key in re.findall(r"`([a-z_][\w.]*)`", cells[1]):
                yield pytest.param(key, id=f"docs/from-dle.md:{number}:{key}")


@pytest.mark.parametrize("key", list(dle_table_keys()))
def test_every_key_the_dle_tables_name_is_in_the_schema(key):
    assert _schema_has(key), f"{key}: not a config key (config.schema.yaml)"


def test_the_dle_tables_are_read_by_the_check_above():
    keys = {param.values[0] for param in dle_table_keys()}
    assert {"pretrain.phase1.global_batch_size", "pretrain.phase1.micro_batch_size", "squad.batch_size",
            "encode.dupe_factor", "shard.n_training_shards", "seed"} <= keys
    assert not _schema_has("pretrain.phase1.gradient_accumulation_steps")  # the check can fail


def python_imports():
    """`from transformers import A, B` in the pages' ```python blocks: what a user's code loads the exports with."""
    for page in PAGES:
        for start, lines, _ in _paragraphs(page.read_text()):
            if lines[0] == "```python":
                for names in re.findall(r"^from transformers import (.+)$", "\n".join(lines), re.M):
                    for name in names.split(","):
                        yield pytest.param(name.strip(), id=f"{page.relative_to(REPO)}:{start}:{name.strip()}")


@pytest.mark.parametrize("name", list(python_imports()))
def test_every_hugging_face_class_the_pages_load_with_exists(name):
    import transformers

    assert hasattr(transformers, name), f"transformers {transformers.__version__} has no {name}"


def test_the_install_page_names_what_make_setup_runs():
    """docs/install.md says what `make setup` does: the commands make would run say the same."""
    plan = subprocess.run(["make", "-n", "-B", "setup"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert "-m venv .venv" in plan.stdout and "pip install --quiet -r requirements-test.txt" in plan.stdout
    page = (REPO / "docs" / "install.md").read_text()
    assert "python3 -m venv .venv" in page and "pip install -r requirements-test.txt" in page and ".venv-pypy" in page


def _merged(snippets: list[dict]) -> dict:
    """The page's config snippets as one config, later keys over earlier ones (as the reader edits config.yaml)."""
    merged: dict = {}
    for snippet in snippets:
        for key, value in snippet.items():
            merged[key] = merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def test_the_own_corpus_recipe_plans_german_pretraining_and_the_tasks_without_an_english_download(workdir, tmp_path):
    """docs/own-corpus.md's snippets, together, on stand-ins for the reader's files: `all` plans the corpus, both
    phases and the two tasks, and downloads nothing (no Wikipedia, no SQuAD, no GLUE)."""
    config = _merged([snippet for where, snippet, _ in SNIPPETS if where.startswith("docs/own-corpus.md:")])
    assert set(config) >= {"wikipedia", "corpora", "shard", "pretrain", "squad", "tasks"}, sorted(config)
    corpus = tmp_path / "news_de"
    corpus.mkdir()
    with gzip.open(corpus / "part-0.jsonl.gz", "wt") as out:
        out.write('{"text": "Die Stadt liegt am Rhein. Sie hat einen Hafen."}\n')
    config["corpora"]["news_de"]["path"] = f"{corpus}/*.jsonl.gz"
    for name, task in config["tasks"].items():
        for split in ("train", "dev", "test"):
            if split in task:
                path = tmp_path / name / Path(task[split]).name
                path.parent.mkdir(exist_ok=True)
                path.write_text("Berlin B-LOC\nliegt O\n\n" if task["format"] == "conll" else "text,label\ngut,pos\n")
                task[split] = str(path)
    (workdir / "own-corpus.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/local", "-n", "all",
                             "--configfile", "own-corpus.yaml"], cwd=workdir, capture_output=True, text=True,
                            env=snakemake_env(), timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", result.stdout, re.M))
    assert not [rule for rule in jobs if rule.startswith("download")], jobs
    assert not [rule for rule in jobs if rule.startswith(("squad", "glue"))], jobs
    assert jobs.get("pretrain_phase") == "2" and int(jobs.get("tokenize", 0)) == 64 + 16, jobs
    assert "results/tasks/ner/eval.json" in output and "results/tasks/sentiment/eval.json" in output


def test_the_guides_hugging_face_code_runs_on_an_export(tmp_path):
    """docs/own-corpus.md's code for the pretrained model, run as written on a tiny export of both recipes' kinds:
    BertForPreTraining, BertForMaskedLM and the fill-mask pipeline load it and predict."""
    import contextlib
    import io

    import torch

    from workflow.train.models.bert import BertConfig, BertForPreTraining, save_pretrained

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Berlin", "ist", "die", "Hauptstadt", "von",
             "Deutschland", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    config = BertConfig.preset("tiny", vocab_size=len(words))
    torch.manual_seed(0)
    export = tmp_path / "results" / "pretrain" / "phase2" / "model"
    save_pretrained(BertForPreTraining(config), config, tmp_path / "vocab.txt", export)
    blocks = ["\n".join(lines[1:-1]) for start, lines, _ in _paragraphs((REPO / "docs" / "own-corpus.md").read_text())
              if lines[0] == "```python" and "results/pretrain/phase2/model" in "\n".join(lines)]
    assert len(blocks) == 1
    printed = io.StringIO()
    with contextlib.chdir(tmp_path), contextlib.redirect_stdout(printed):
        exec(compile(blocks[0], "docs/own-corpus.md", "exec"), {})
    predictions = eval(printed.getvalue())  # the pipeline's list of dicts, printed
    assert len(predictions) == 5 and {p["token_str"] for p in predictions} <= set(words), predictions
