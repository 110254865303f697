"""A decode round's instructions and cache misses, counted by cachegrind (no timing noise).

    .venv/bin/python bench/step_counts.py [--running 256] [--steps 20] [--no-write-slots] [--json PATH]

Needs valgrind (``cachegrind``, ``cg_diff``, ``cg_annotate``) on the PATH; the
manager's tests and the other benchmarks do not. It runs this script twice
under cachegrind, each run building the same manager as ``bench/numpy_cold.py``
(``--running`` chat requests on the V4-Flash 40 GiB shared arena, prefix
caching on) and then rounds of: an 8 MiB ``zlib.crc32`` stream (which evicts a
core's caches, as another component's work between two steps does), a decode
step (``schedule_uniform``, "updates" block tables) and the sampled tokens
appended (``append_token_ids_many``), what an engine calls once a step. The
second run makes ``--steps`` more rounds than the first; the difference of the
two, per round, less the stream's own function, is a round's cost:

* ``Ir``: instructions executed (tracks the warm time);
* LL misses with the last level set to 2 MiB (one core's L2 here): code lines
  fetched (``ILmr``), data lines read (``DLmr``) and written (``DLmw``).

Counts are exact for a given numpy and CPython build, so two versions of the
code compare without the machine's noise. They are not a time: misses on
sequential buffers cost little (the hardware prefetches them), while code and
scattered reads cost a memory latency each. Prints a table (totals and the
functions with the most misses) and writes ``bench/out/step_counts.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

LL = "--LL=2097152,16,64"
EVENTS = ("Ir", "ILmr", "DLmr", "DLmw")
_STREAM = bytes(range(256)) * (8 * 4096)  # 8 MiB
_BASE_ROUNDS = 5  # the shorter run's rounds after the warm-up
_MAX_ROUNDS = 1000


def child(running: int, rounds: int, write_slots: bool) -> None:
    """The measured process: build, warm up, then ``rounds`` rounds."""
    import gc

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from numpy_cold import _decode_manager

    mgr, ids = _decode_manager(running, _MAX_ROUNDS + 8)  # one size for every run: the builds match
    tokens = np.random.default_rng(2).integers(0, 100_000, size=(rounds + 8, len(ids)))
    for k in range(rounds + 5):
        if k == 5:
            gc.collect()
            gc.disable()
        zlib.crc32(_STREAM)
        mgr.schedule_uniform(ids, 1, block_tables="updates", write_slots=write_slots)
        mgr.append_token_ids_many(ids, tokens[k][:, None])
    sys.stdout.flush()
    os._exit(0)  # no teardown: freeing what the rounds left behind would count as theirs


def _number(text: str) -> int:
    return 0 if text == "." else int(text.replace(",", ""))


def parse_annotate(text: str) -> tuple[dict[str, int], list[dict]]:
    """Program totals and per-function rows of ``cg_annotate --show=Ir,ILmr,DLmr,DLmw``."""
    cell = r"([-\d,]+|\.)\s+(?:\([^)]*\)\s+)?"
    row = re.compile(r"^\s*" + cell * 4 + r"(\S.*)$")
    totals, functions = None, []
    for line in text.splitlines():
        m = row.match(line)
        if not m:
            continue
        values = dict(zip(EVENTS, map(_number, m.groups()[:4])))
        name = m.group(5).strip()
        if "PROGRAM TOTALS" in name:
            totals = totals or values
        elif ":" in name:
            functions.append(dict(values, function=name))
    if totals is None:
        raise RuntimeError("no totals in cg_annotate output")
    return totals, functions


def measure(running: int, steps: int, write_slots: bool) -> dict:
    for tool in ("valgrind", "cg_diff", "cg_annotate"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: this benchmark needs valgrind")
    with tempfile.TemporaryDirectory() as tmp:
        procs, outs = [], []
        for rounds in (_BASE_ROUNDS, _BASE_ROUNDS + steps):
            out = os.path.join(tmp, f"cg.{rounds}.out")
            outs.append(out)
            cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", LL, f"--cachegrind-out-file={out}",
                   sys.executable, __file__, "--child", str(rounds), "--running", str(running)
                   ] + ([] if write_slots else ["--no-write-slots"])
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")  # no idle BLAS threads counted
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                raise SystemExit(f"cachegrind run failed:\n{err[-2000:]}")
        diff = os.path.join(tmp, "diff.out")
        with open(diff, "w") as f:
            subprocess.run(["cg_diff", outs[0], outs[1]], check=True, stdout=f)
        text = subprocess.run(["cg_annotate", "--show=" + ",".join(EVENTS), "--sort=ILmr", "--threshold=0", diff],
                              check=True, capture_output=True, text=True).stdout
    totals, functions = parse_annotate(text)
    stream = [f for f in functions if f["function"].endswith(":crc32_z")]
    functions = [f for f in functions if f not in stream]
    per_round = {k: (v - sum(f[k] for f in stream)) / steps for k, v in totals.items()}
    per_round["LL misses"] = per_round["ILmr"] + per_round["DLmr"] + per_round["DLmw"]
    for f in functions:
        f["misses"] = (f["ILmr"] + f["DLmr"] + f["DLmw"]) / steps
    functions.sort(key=lambda f: -f["misses"])
    top = [dict(function=f["function"], misses_per_round=f["misses"], instructions_per_round=f["Ir"] / steps)
           for f in functions[:25]]
    return dict(running=running, steps=steps, write_slots=write_slots, ll_bytes=2 * 2**20, per_round=per_round,
                top_functions=top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-write-slots", dest="write_slots", action="store_false")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "out" / "step_counts.json")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.running, args.child, args.write_slots)
        return 0
    from rich.console import Console
    from rich.table import Table

    if not 1 <= args.steps <= _MAX_ROUNDS - _BASE_ROUNDS:
        parser.error(f"--steps must lie in [1, {_MAX_ROUNDS - _BASE_ROUNDS}]")
    result = measure(args.running, args.steps, args.write_slots)
    console = Console()
    s = result["per_round"]
    table = Table(title=f"one decode round (step + append), {args.running} running, write slots "
                        f"{'on' if args.write_slots else 'off'} (mean of {args.steps})")
    for col in ("instructions", "LL misses", "code lines", "data lines read", "data lines written"):
        table.add_column(col, justify="right")
    table.add_row(*(f"{v:,.0f}" for v in (s["Ir"], s["LL misses"], s["ILmr"], s["DLmr"], s["DLmw"])))
    console.print(table)
    top = Table(title="functions with the most LL misses per round")
    top.add_column("misses", justify="right")
    top.add_column("instructions", justify="right")
    top.add_column("function")
    for f in result["top_functions"][:15]:
        top.add_row(f"{f['misses_per_round']:,.0f}", f"{f['instructions_per_round']:,.0f}", f["function"][-70:])
    console.print(top)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
