"""Loading a script of bench/ (not a package) as a module, for the tests of its pure parts."""

import importlib.util
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def load_bench_script(filename: str, module_name: str):
    """``bench/<filename>`` imported under ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
