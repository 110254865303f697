"""A decode step's instructions and cache misses, counted by cachegrind (no timing noise).

    .venv/bin/python bench/step_counts.py [--running 256] [--steps 20] [--no-write-slots] [--json PATH]

Needs valgrind (``cachegrind``, ``cg_diff``, ``cg_annotate``) on the PATH; the
manager's tests and the other benchmarks do not. It runs this script twice
under cachegrind, each run building the same manager as ``bench/numpy_cold.py``
(``--running`` chat requests on the V4-Flash 40 GiB shared arena, prefix
caching on) and then ``--steps`` rounds of: an 8 MiB ``zlib.crc32`` stream
(which evicts a core's caches, as another component's work between two steps
does), a decode step (``schedule_uniform``, "updates" block tables), and the
sampled tokens appended. The second run leaves out the step; the difference of
the two, per step, is the step's own cost:

* ``Ir``: instructions executed (tracks the warm step time);
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


def child(running: int, steps: int, with_step: bool, write_slots: bool) -> None:
    """The measured process: build, warm up, then ``steps`` rounds (step or not)."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from numpy_cold import _decode_manager

    mgr, ids = _decode_manager(running, steps + 16)
    tokens = np.random.default_rng(2).integers(0, 100_000, size=(steps + 8, len(ids)))
    for k in range(5):
        mgr.schedule_uniform(ids, 1, block_tables="updates", write_slots=write_slots)
        mgr.append_token_ids_many(ids, tokens[k][:, None])
    import gc

    gc.collect()
    gc.disable()
    for k in range(steps):
        zlib.crc32(_STREAM)
        if with_step:
            mgr.schedule_uniform(ids, 1, block_tables="updates", write_slots=write_slots)
            mgr.append_token_ids_many(ids, tokens[5 + k][:, None])
        else:
            mgr.append_token_ids_many(ids, tokens[5 + k][:, None])
    sys.stdout.flush()
    os._exit(0)  # no teardown: freeing what the steps left behind would count as theirs


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
        for with_step in (True, False):
            out = os.path.join(tmp, f"cg.{int(with_step)}.out")
            outs.append(out)
            cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", LL, f"--cachegrind-out-file={out}",
                   sys.executable, __file__, "--child", str(int(with_step)), "--running", str(running),
                   "--steps", str(steps)] + ([] if write_slots else ["--no-write-slots"])
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                raise SystemExit(f"cachegrind run failed:\n{err[-2000:]}")
        diff = os.path.join(tmp, "diff.out")
        subprocess.run(["cg_diff", outs[1], outs[0]], check=True, stdout=open(diff, "w"))
        text = subprocess.run(["cg_annotate", "--show=" + ",".join(EVENTS), "--sort=ILmr", "--threshold=0", diff],
                              check=True, capture_output=True, text=True).stdout
    totals, functions = parse_annotate(text)
    per_step = {k: v / steps for k, v in totals.items()}
    per_step["LL misses"] = per_step["ILmr"] + per_step["DLmr"] + per_step["DLmw"]
    for f in functions:
        f["misses"] = (f["ILmr"] + f["DLmr"] + f["DLmw"]) / steps
    functions.sort(key=lambda f: -f["misses"])
    top = [dict(function=f["function"], misses_per_step=f["misses"], instructions_per_step=f["Ir"] / steps)
           for f in functions[:25]]
    return dict(running=running, steps=steps, write_slots=write_slots, ll_bytes=2 * 2**20, per_step=per_step,
                top_functions=top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-write-slots", dest="write_slots", action="store_false")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "out" / "step_counts.json")
    parser.add_argument("--child", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.running, args.steps, bool(args.child), args.write_slots)
        return 0
    from rich.console import Console
    from rich.table import Table

    result = measure(args.running, args.steps, args.write_slots)
    console = Console()
    s = result["per_step"]
    table = Table(title=f"one decode step, {args.running} running, write slots "
                        f"{'on' if args.write_slots else 'off'} (mean of {args.steps})")
    for col in ("instructions", "LL misses", "code lines", "data lines read", "data lines written"):
        table.add_column(col, justify="right")
    table.add_row(*(f"{v:,.0f}" for v in (s["Ir"], s["LL misses"], s["ILmr"], s["DLmr"], s["DLmw"])))
    console.print(table)
    top = Table(title="functions with the most LL misses per step")
    top.add_column("misses", justify="right")
    top.add_column("instructions", justify="right")
    top.add_column("function")
    for f in result["top_functions"][:15]:
        top.add_row(f"{f['misses_per_step']:,.0f}", f"{f['instructions_per_step']:,.0f}", f["function"][-70:])
    console.print(top)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
