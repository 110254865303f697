"""The CLI's import boundary: ``hybridkv --help`` and ``hybridkv plan`` load only what
they use (start-up time is measured in the report, not here)."""

import json
import subprocess
import sys

import pytest

HEAVY = ("matplotlib", "ml_dtypes", "numba", "hybridkv.sim", "hybridkv.runtime.manager", "hybridkv.reference", "torch")


def _modules_after(code: str) -> set[str]:
    script = (
        "import sys, io, contextlib\n"
        "from hybridkv.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    {code}\n"
        "print(__import__('json').dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


def _loaded(modules: set[str], name: str) -> bool:
    return any(m == name or m.startswith(name + ".") for m in modules)


@pytest.mark.parametrize("code", ["pass", "main(['--help'])", "main([])"])
def test_help_imports_neither_numpy_nor_rich_nor_the_library(code):
    modules = _modules_after(code)
    for name in HEAVY + ("numpy", "rich", "hybridkv.spec", "hybridkv.plan"):
        assert not _loaded(modules, name), name


def test_plan_imports_no_numpy_rich_or_subcommand_it_does_not_run():
    modules = _modules_after("main(['plan'])")
    for name in HEAVY + ("numpy", "rich", "hybridkv.cli.simulate_cmd", "hybridkv.cli.verify_cmd"):
        assert not _loaded(modules, name), name
    assert "hybridkv.plan" in modules


def test_simulate_help_does_not_import_the_simulator():
    modules = _modules_after("main(['simulate', '--help'])")
    for name in HEAVY + ("numpy",):
        assert not _loaded(modules, name), name


def test_the_light_name_lists_match_the_library():
    from hybridkv.cli import plan_cmd, simulate_cmd
    from hybridkv.models.layout import BUNDLED_MODELS, INDEXER_FORMATS
    from hybridkv.sim.workloads import WORKLOAD_NAMES

    assert plan_cmd.BUNDLED_MODELS == BUNDLED_MODELS
    assert plan_cmd.INDEXER_FORMATS == INDEXER_FORMATS
    assert simulate_cmd.WORKLOAD_NAMES == WORKLOAD_NAMES


def test_python_dash_m_hybridkv_runs_the_command_line():
    done = subprocess.run([sys.executable, "-m", "hybridkv", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("hybridkv")
