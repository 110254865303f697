import os
import sys
from pathlib import Path

import pytest

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


BENCH = str(Path(__file__).resolve().parent.parent / "bench")


@pytest.fixture(scope="module")
def vs():
    """bench/vs_vllm (the side-by-side package), imported from bench/ for the module's tests."""
    sys.path.insert(0, BENCH)
    try:
        import vs_vllm.cli
        import vs_vllm.decode
        import vs_vllm.serving
        import vs_vllm.sides
        import vs_vllm.timing
        import vs_vllm.workload

        yield vs_vllm
    finally:
        sys.path.remove(BENCH)
