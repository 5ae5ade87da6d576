"""Each rule's conda env provides every third-party module its code imports, pinned to the tested versions.

Conda channels are unreachable here, so the envs cannot be built; this test keeps them honest instead. It loads
the workflow with Snakemake's own parser, follows each rule's `python -m workflow.X` (recursively through the
`workflow.*` modules it imports) and checks the env's dependency list against those imports.
"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PYTHON_MODULE = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
OPTIONAL_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def workflow_rules() -> dict[str, tuple[str | None, str]]:
    """{rule name: (conda env path or None, shell command)} for every rule of the workflow (default config)."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (ConfigSettings, OutputSettings, ResourceSettings, StorageSettings,
                                          WorkflowSettings)

    with SnakemakeApi(OutputSettings()) as api:
        workflow_api = api.workflow(resource_settings=ResourceSettings(), config_settings=ConfigSettings(),
                                    storage_settings=StorageSettings(), workflow_settings=WorkflowSettings(),
                                    snakefile=REPO / "Snakefile", workdir=REPO)
        rules = {}
        for rule in workflow_api._workflow.rules:
            env = None
            if rule.conda_env is not None:
                env = str((Path(rule.snakefile).parent / str(rule.conda_env)).resolve())
            rules[rule.name] = (env, rule.shellcmd or "")
        return rules


def _is_optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """An import inside `try: ... except ImportError:` is an optional accelerator (e.g. apex), not a requirement."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            for handler in parent.handlers:
                names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                if any(isinstance(n, ast.Name) and n.id in OPTIONAL_IMPORT_ERRORS for n in names):
                    return True
        node = parent
    return False


@cache
def module_imports(module: str, _visiting: frozenset[str] = frozenset()) -> frozenset[str]:
    """Top-level names of the third-party modules `module` needs, through every `workflow.*` module it imports
    (an import cycle between workflow modules is followed once)."""
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = REPO / module.replace(".", "/") / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    needed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        if _is_optional(node, parents):
            continue
        for name in names:
            top = name.split(".")[0]
            if top == "workflow":
                if (REPO / (name.replace(".", "/") + ".py")).exists() and name != module and name not in _visiting:
                    needed |= module_imports(name, _visiting | {module})
            elif top not in sys.stdlib_module_names and top != "__future__":
                needed.add(top)
    return frozenset(needed)


def rule_imports(shellcmd: str) -> set[str]:
    needed: set[str] = set()
    for module in PYTHON_MODULE.findall(shellcmd):
        if module.split(".")[0] == "workflow":
            needed |= module_imports(module)
        else:
            needed.add(module.split(".")[0])
    return needed


def env_packages(env_file: str) -> dict[str, str]:
    """{normalized distribution name: pinned version} of a conda env file (conda and pip dependencies)."""
    spec = yaml.safe_load(Path(env_file).read_text(encoding="utf-8"))
    pins = {}
    for dependency in spec["dependencies"]:
        entries = dependency["pip"] if isinstance(dependency, dict) else [dependency]
        for entry in entries:
            if entry.startswith("-"):  # pip options such as --extra-index-url
                continue
            name, _, version = re.match(r"([A-Za-z0-9_.\-]+)\s*(==|=)?\s*(\S*)", entry).groups()
            pins[normalize(name)] = version
    return pins


def distribution(import_name: str) -> str:
    """The distribution that provides a top-level import name in the test venv (pynvml -> nvidia-ml-py)."""
    providers = importlib.metadata.packages_distributions().get(import_name)
    if not providers:
        pytest.fail(f"module {import_name!r} is imported by a rule's code but is not installed in the test venv")
    return normalize(providers[0])


RULES = workflow_rules()
SHELL_RULES = sorted(name for name, (_, shell) in RULES.items() if shell)
# Rules whose command is a plain tool, no Python of ours: nothing to import (clean_intermediates: rm).
PLAIN_TOOLS = ("rm -rf ",)


def test_every_rule_with_a_command_has_a_conda_env():
    missing = [name for name in SHELL_RULES if RULES[name][0] is None]
    assert not missing, f"rules without conda: {missing}"
    assert len(SHELL_RULES) >= 10, SHELL_RULES  # the whole DAG was parsed, not an empty workflow


@pytest.mark.parametrize("rule", SHELL_RULES)
def test_rule_env_provides_every_imported_module(rule):
    env_file, shellcmd = RULES[rule]
    if shellcmd.startswith(PLAIN_TOOLS):
        assert "python" not in shellcmd, shellcmd
        return
    assert PYTHON_MODULE.search(shellcmd), f"rule {rule}: no `python -m ...` in {shellcmd!r}"
    provided = env_packages(env_file)
    missing = sorted({f"{name} (pip/conda: {distribution(name)})" for name in rule_imports(shellcmd)
                      if distribution(name) not in provided})
    assert not missing, f"rule {rule}: {Path(env_file).name} lacks {missing}"


def pypy_pins_match_the_tested_pypy(pins: dict[str, str]) -> None:
    """A PyPy env (python `X.Y.*=*_pypy`, pypyX.Y pinned: envs/extract.yaml) pins the PyPy the tests run
    (benchmarks.wikipedia_sample.pypy_python), and its pip packages that PyPy's versions; without one here, only
    the pins' form is checked (the pip pins then against this venv's)."""
    import subprocess

    from benchmarks.wikipedia_sample import pypy_python

    language = re.fullmatch(r"(\d+)\.(\d+)\.\*=\*_pypy", pins["python"])
    assert language, pins["python"]
    interpreter = f"pypy{language[1]}-{language[2]}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", pins.get(interpreter, "")), f"{interpreter} is not pinned exactly"
    pypy = pypy_python()
    if pypy is None:
        return
    probe = ("import sys, importlib.metadata as m; print('.'.join(map(str, sys.version_info[:2])), "
             "'.'.join(map(str, sys.pypy_version_info[:3])), m.version('wikiextractor'))")
    python, version, wikiextractor = subprocess.run([str(pypy), "-c", probe], capture_output=True, text=True,
                                                   check=True).stdout.split()
    assert (f"{language[1]}.{language[2]}", pins[interpreter], pins["wikiextractor"]) == (python, version, wikiextractor)


REQUIREMENTS = ("requirements.txt", "requirements-test.txt", "requirements-gpu.txt")
GPU_ONLY = "requirements-gpu.txt"  # pinned for envs/train.yaml, not installed in the CPU test venv


def requirement_pins(*files: str) -> dict[str, str]:
    """{normalized name: version} of the `name==version` lines of requirements files."""
    pins = {}
    for file in files:
        for line in (REPO / file).read_text(encoding="utf-8").splitlines():
            match = re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
            if match:
                pins[normalize(match[1])] = match[2]
    return pins


@pytest.mark.parametrize("env_file", sorted(str(p) for p in (REPO / "envs").glob("*.yaml")))
def test_env_pins_are_exact_and_match_the_tested_versions(env_file):
    pins = env_packages(env_file)
    if pins.get("python", "").endswith("_pypy"):
        pypy_pins_match_the_tested_pypy(pins)
    else:
        assert pins.get("python") == f"{sys.version_info.major}.{sys.version_info.minor}", pins.get("python")
    gpu_only = requirement_pins(GPU_ONLY)
    for name, version in pins.items():
        if name in ("python", "pip") or name.startswith("pypy") or name in gpu_only:
            continue
        assert re.fullmatch(r"\d+(\.\d+)*", version), f"{Path(env_file).name}: {name} is not pinned exactly"
        installed = importlib.metadata.version(name).split("+")[0]  # 2.13.0+cpu here, the CUDA build there
        assert version == installed, f"{Path(env_file).name}: {name}={version}, tests run with {installed}"


@pytest.mark.parametrize("env_file", sorted(str(p) for p in (REPO / "envs").glob("*.yaml")))
def test_env_pins_are_the_requirements_files_pins_and_no_deprecated_channel(env_file):
    """One source of pins: every package an env pins (but its interpreter) is pinned alike in a requirements file;
    PyPy's env pins its own wikiextractor build, the same version. No conda `pytorch`/`nvidia` channel (deprecated:
    torch comes from pip)."""
    required = requirement_pins(*REQUIREMENTS)
    pins = env_packages(env_file)
    differing = {name: (version, required.get(name)) for name, version in pins.items()
                 if name not in ("python", "pip") and not name.startswith("pypy") and required.get(name) != version}
    assert not differing, f"{Path(env_file).name}: (env, requirements) pins differ: {differing}"
    channels = yaml.safe_load(Path(env_file).read_text(encoding="utf-8")).get("channels", [])
    assert not {"pytorch", "nvidia"} & set(channels), channels


def python_floor(requires_python: str | None) -> tuple[int, ...]:
    """(major, minor) of a `Requires-Python`'s `>=` bound; (0,) where it has none."""
    match = re.search(r">=\s*(\d+(?:\.\d+)*)", requires_python or "")
    return tuple(int(part) for part in match[1].split("."))[:2] if match else (0,)


def test_the_makefiles_python_floor_is_the_highest_floor_of_the_pinned_packages():
    """The Makefile's PYTHON_FLOOR is what the CPU venv's pins need: the highest `Requires-Python` among them."""
    floors = {name: python_floor(importlib.metadata.metadata(name).get("Requires-Python"))
              for name in requirement_pins("requirements.txt", "requirements-test.txt")}
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    floor = tuple(int(part) for part in re.search(r"^PYTHON_FLOOR := (\S+)$", makefile, re.M)[1].split("."))
    assert floor == max(floors.values()), {name: value for name, value in floors.items() if value > floor}
    assert floor <= sys.version_info[:2]


def test_make_setup_below_the_python_floor_stops_with_one_error_line_before_making_a_venv(tmp_path):
    """A Python below the floor (here: the floor raised above this interpreter) stops `make setup` with one `error:`
    line naming the interpreter, its version and the floor, before any venv or download."""
    for name in ("Makefile", *REQUIREMENTS):
        shutil.copy2(REPO / name, tmp_path / name)
    made = subprocess.run(["make", "-C", str(tmp_path), "setup", f"PYTHON={sys.executable}", "PYTHON_FLOOR=99.0"],
                          capture_output=True, text=True, timeout=60)
    version = sys.version.split()[0]
    errors = [line for line in made.stderr.splitlines() if line.startswith("error:")]
    assert made.returncode != 0 and errors == [
        f"error: snakebert needs Python >= 99.0 (its pins Snakemake 9, numpy and pandas do); {sys.executable} is "
        f"{version}: pick another, e.g. make PYTHON=python3.12"], made.stderr
    assert not (tmp_path / ".venv").exists()


def test_gpu_rules_use_the_cuda_env():
    gpu_rules = [name for name in ("pretrain_phase", "squad_finetune") if name in RULES]
    assert gpu_rules, "no GPU rule found"
    for name in gpu_rules:
        assert Path(RULES[name][0]).name == "train.yaml", name
    assert "download.pytorch.org/whl/cu" in (REPO / "envs" / "train.yaml").read_text()


def test_import_scan_finds_transitive_and_skips_optional_imports(tmp_path):
    # The scanner itself: workflow.train.pretrain reaches torch through workflow.* imports; apex (try/except) is optional.
    pretrain = REPO / "workflow" / "train" / "pretrain.py"
    if not pretrain.exists():
        pytest.skip("workflow/train/pretrain.py not present yet")
    needed = module_imports("workflow.train.pretrain")
    assert "torch" in needed and "apex" not in needed, needed
