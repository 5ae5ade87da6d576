"""`snakemake --lint` is clean: for the default config and for the demo config (rules differ by config)."""
import subprocess

import pytest

from tests.conftest import snakemake_env


@pytest.mark.parametrize("configfile", ["config.yaml", "sample/config.yaml"])
def test_snakemake_lint_is_clean(configfile, workflow_copy):
    result = subprocess.run(["snakemake", "--lint", "--configfile", configfile], cwd=workflow_copy, env=snakemake_env(),
                            capture_output=True, text=True, timeout=120)
    report = result.stdout + result.stderr
    assert result.returncode == 0 and "Lints for" not in report, report
