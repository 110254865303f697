"""A/B of hybridkv's decode step at two commits, each step right after a vLLM step.

Run with the vLLM environment (bench/README.md), from the repository root:

    PYTHONPATH=src /work/venv-vllm/bin/python bench/decode_ab.py --base f429c17    # ~1 min for 6 rounds
    PYTHONPATH=src /work/venv-vllm/bin/python bench/decode_ab.py --base HEAD~1 --rounds 4 --steps 64

``vs_vllm``'s decode phase runs a vLLM step (one ``allocate_slots`` per
request, ~10 ms of Python at 256) before each hybridkv step, so hybridkv's step
starts with cold caches; plain Python in its place (as ``numpy_cold.py`` does)
misjudges some changes. Here two vLLM managers and two hybridkv managers (the
working tree and ``--base``, a commit exported with ``git archive`` and imported
under another package name) get the same requests (``vs_vllm.decode``'s
set-up: ``--requests`` serving-workload requests on the 40 GiB V4-Flash arena,
caching on, write slots on, updates mode), and every step runs vLLM A, base,
vLLM B, new (the pairs' order alternating). Each round sets up afresh. Prints each round's mean per running
request and the ratio new / base, and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from vs_vllm.decode import DecodeDriver  # noqa: E402
from vs_vllm.sides import GIB, HybridkvSide  # noqa: E402
from vs_vllm.timing import quiet_gc  # noqa: E402
from vs_vllm.workload import ServingShape  # noqa: E402

BASE_PACKAGE = "hybridkv_base"


def export_base(rev: str, into: Path) -> None:
    """``src/hybridkv`` at ``rev`` as package ``hybridkv_base`` under ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src/hybridkv"], check=True,
                             capture_output=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / BASE_PACKAGE
    (into / "src" / "hybridkv").rename(package)
    word = re.compile(r"\bhybridkv\b(?=[.\s])")
    for path in package.rglob("*.py"):
        path.write_text(word.sub(BASE_PACKAGE, path.read_text()))


class BaseSide(HybridkvSide):
    """``HybridkvSide`` on the exported base package."""

    name = "base"
    package = BASE_PACKAGE


def run(rounds: int, steps: int, requests: int) -> list[dict]:
    from vs_vllm.vllm_side import VllmSide

    kwargs = dict(kv_memory_bytes=40 * GIB, max_model_len=131_072, max_num_batched_tokens=2048,
                  max_num_seqs=requests)
    sides = {"base": BaseSide(**kwargs), "new": HybridkvSide(**kwargs),
             "vllm_a": VllmSide(**kwargs), "vllm_b": VllmSide(**kwargs)}
    out = []
    for r in range(rounds):
        drivers = {}
        for name, side in sides.items():
            if not side.reset_prefix_cache():
                raise RuntimeError("prefix cache could not be reset")
            drivers[name] = DecodeDriver(side, running=requests, total_steps=steps, chunk_tokens=2048,
                                         shape=ServingShape(), seed=r)
            drivers[name].start()
        step_ns = {"base": np.zeros(steps), "new": np.zeros(steps)}
        with quiet_gc():
            for step in range(steps):
                pairs = [("vllm_a", "base"), ("vllm_b", "new")]
                for before, name in pairs if (step + r) % 2 == 0 else pairs[::-1]:
                    drivers[before].step(step)
                    step_ns[name][step] = drivers[name].step(step)
        for driver in drivers.values():
            driver.stop()
        base, new = (float(step_ns[n].mean() / requests / 1e3) for n in ("base", "new"))
        out.append(dict(base_us_per_request_step=base, new_us_per_request_step=new, ratio=new / base))
        print(f"round {r}: base {base:.3f} new {new:.3f} µs per running request per step, new/base {new / base:.3f}",
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--json", type=Path, default=BENCH_DIR / "out" / "decode_ab.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        export_base(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        rounds = run(args.rounds, args.steps, args.requests)
    ratios = [r["ratio"] for r in rounds]
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode step, working tree against {args.base} (vLLM step before each)")
    for column in ("round", "base µs", "new µs", "new / base"):
        table.add_column(column, justify="right")
    for i, r in enumerate(rounds):
        table.add_row(str(i), f"{r['base_us_per_request_step']:.3f}", f"{r['new_us_per_request_step']:.3f}",
                      f"{r['ratio']:.3f}")
    table.add_row("median", "", "", f"{float(np.median(ratios)):.3f}")
    Console().print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(base=args.base, steps=args.steps, requests=args.requests, rounds=rounds,
                                         median_ratio=float(np.median(ratios))), indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
