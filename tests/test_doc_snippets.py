"""The Python snippets of README.md, docs/manager.md and docs/planning.md run as printed, so they cannot rot.

Each test takes the page's fenced ``python`` block verbatim and runs it; names the README
leaves to the engine (the prompt, the sampled token, ...) are given first. Then the figures the
snippet's comments quote are checked against what it computed.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_readme_library_snippet_runs():
    (block,) = _python_blocks("README.md")
    names = {
        "prompt_ids": list(range(1, 2049)),  # one 2,048-token chunk computes the whole prompt
        "sampled": 7,
        "accepted_tokens": 2048,  # between the last step's first position and its end
    }
    exec(compile(block, "README.md", "exec"), names)
    mgr, step = names["mgr"], names["step"]
    assert names["hit"].hit_tokens == 0
    assert not mgr.has_request("r1")
    history = step.groups["v4.c4a.compressed_kv"].block_table
    assert history.dtype == np.int32 and history.shape[0] == 1
    swa = step.groups["v4.swa_kv"]
    assert swa.base_pages.dtype == np.int32 and swa.base_pages.shape == (1,)
    assert swa.write_slots.dtype == np.int64 and swa.write_slots.shape == (2048,)


def test_readme_decode_comments_name_calls_that_run():
    """The decode calls the README's comments describe, on the manager its snippet builds."""
    from hybridkv.tables.mirror import BlockTableMirror

    (block,) = _python_blocks("README.md")
    names = {"prompt_ids": list(range(1, 2049)), "sampled": 7, "accepted_tokens": 2048}
    exec(compile(block.split("mgr.rewind(")[0], "README.md", "exec"), names)
    mgr = names["mgr"]
    running_ids = ["r1"]
    mgr.schedule_uniform(running_ids, 1)
    mirror = BlockTableMirror.for_manager(mgr)
    sampled = np.array([9])
    mgr.append_token_ids_many(running_ids, sampled[:, None])
    batch = mgr.schedule_uniform(running_ids, 1, block_tables="updates", write_slots=False)
    mirror.apply(batch)
    assert batch.groups["v4.swa_kv"].write_slots is None
    assert mirror.block_table("v4.swa_kv").shape[0] == 1


def test_planning_python_api_snippet_runs_and_gives_its_figures():
    (block,) = _python_blocks("docs/planning.md")
    names: dict = {}
    exec(compile(block, "docs/planning.md", "exec"), names)
    plan, vllm = names["plan"], names["vllm"]
    assert plan.page_space == "shared"
    assert plan.group_pages["v4.swa_kv"] == 513
    assert plan.concurrency(128 * 1024) == (117, "v4.c4a.compressed_kv")
    # V4-Pro, 80 GiB: head 2 x 1,253,760 B, slabs of 16 x 1,253,760 B, so (80 GiB - head) // slab = 4,281;
    # 117 requests at 128k would fill 4,307 slabs (3,752 of them compressed KV at 16 pages a slab).
    assert (80 * 2**30 - 2 * 1_253_760) // (16 * 1_253_760) == 4281 and -(-117 * 513 // 16) == 3752
    from hybridkv.memory.arena import shared_arena_for, shared_concurrency

    assert (shared_arena_for(plan).num_slabs, shared_concurrency(plan, 128 * 1024)) == (4281, 116)
    assert plan.table_widths["v4.swa_kv"] == 4 and plan.table_widths["v4.c4a.compressed_kv"] == 4097
    assert round(vllm.logged_concurrency, 2) == 5.96 and vllm.admitted_requests == 67


def test_manager_engine_loop_snippet_runs():
    block = _python_blocks("docs/manager.md")[0]
    names: dict = {}
    exec(compile(block, "docs/manager.md", "exec"), names)
    mgr = names["mgr"]
    assert not mgr.has_request("a") and not mgr.has_request("b")
    assert mgr.stats()["v4.c4a.compressed_kv"].used_pages == 0
    widths = {g: s.block_table.shape[1] for g, s in names["batch"].groups.items()}
    assert widths == names["plan"].table_widths  # fixed_width=True: the plan's capture widths


def _keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def test_planning_names_every_key_of_the_vllm_comparison_json(capsys):
    import json

    from hybridkv.cli import main

    text = (ROOT / "docs/planning.md").read_text(encoding="utf-8")
    paragraph = text.split("With `--json`, `--compare vllm` prints", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"`([a-z_]+)`", paragraph))
    assert main(["plan", "--compare", "vllm", "--json"]) == 0
    assert documented == _keys(json.loads(capsys.readouterr().out))
