"""`snakemake --lint` is clean: for the default config and for the demo config (rules differ by config)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("configfile", ["config.yaml", "sample/config.yaml"])
def test_snakemake_lint_is_clean(configfile):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["snakemake", "--lint", "--configfile", configfile], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    report = result.stdout + result.stderr
    assert result.returncode == 0 and "Lints for" not in report, report
