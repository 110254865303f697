"""Time a decode step spends inside the compiled kernels, two versions side by side.

    PYTHONPATH=src:/tmp/base .venv/bin/python bench/kernel_time.py --against hybridkv_base
        [--sizes 512,1024] [--steps 300]

``bench/step_profile.py``'s decode workload (V4-Flash, 40 GiB shared arena,
prefix caching on, updates mode), one manager per version, their steps
alternating; every kernel the manager calls from Python (``step``,
``run_step``, ``finish_step``, ``read_cells``, ``release_credit``,
``prepare_step``) runs inside a thread-CPU-time timer. Prints, per size and
version, the p50 of the kernels' time per step and of the whole step, and the
ratios (this version over ``--against``). ``--against`` is a copy of another
version renamed to another package, as for ``step_profile.py``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import time

import numpy as np
import step_profile

CLOCK = time.thread_time_ns
TIMED = ("step", "run_step", "finish_step", "read_cells", "release_credit", "prepare_step")


def warm(package: str, steps: int = 40) -> None:
    """Compile (or load from numba's cache) the jitted code a decode workload calls: a jitted kernel that calls
    one of ``TIMED`` must be typed before :func:`time_kernels` swaps it for a Python wrapper numba cannot type."""
    step_profile.decode_steps(step_profile.Workload(2, package=package), steps)


def time_kernels(package: str, spent: list[int]) -> None:
    """Wrap ``package``'s kernels so that each call adds its time to ``spent[0]`` (after :func:`warm`)."""
    kernels = importlib.import_module(f"{package}.runtime.kernels")
    for name in TIMED:
        def timed(*args, _kernel=getattr(kernels, name)):
            start = CLOCK()
            out = _kernel(*args)
            spent[0] += CLOCK() - start
            return out
        setattr(kernels, name, timed)


def run(sizes: list[int], steps: int, against: str) -> None:
    packages = (against, "hybridkv")
    spent = {p: [0] for p in packages}
    for p in packages:
        warm(p)
        time_kernels(p, spent[p])
    for running in sizes:
        work = {p: step_profile.Workload(running, package=p) for p in packages}
        kernel_ns = {p: [] for p in packages}
        step_ns = {p: [] for p in packages}
        gc.disable()
        for _ in range(steps):
            for p in packages:
                ids = tuple(work[p].live)
                spent[p][0] = 0
                start = CLOCK()
                work[p].manager.schedule_uniform(ids, 1, block_tables="updates")
                step_ns[p].append(CLOCK() - start)
                kernel_ns[p].append(spent[p][0])
                work[p].sample(list(ids))
        gc.enable()
        for p in packages:
            print(f"{p:14s} {running:5d}  kernels p50 {np.median(kernel_ns[p]) / 1e3:8.1f} us"
                  f"  step p50 {np.median(step_ns[p]) / 1e3:8.1f} us")
        print(f"{'ratio':14s} {running:5d}  kernels {np.median(kernel_ns['hybridkv']) / np.median(kernel_ns[against]):.2f}"
              f"  step {np.median(step_ns['hybridkv']) / np.median(step_ns[against]):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--against", required=True, help="a renamed copy of another version (e.g. hybridkv_base)")
    a = ap.parse_args()
    run([int(s) for s in a.sizes.split(",")], a.steps, a.against)


if __name__ == "__main__":
    main()
