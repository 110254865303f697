"""Boundaries crossed past the prompt: the step holds their checkpoint, ``free`` publishes it
(docs/prefix-caching.md, "Past the prompt"). Worked on ``test_prefix``'s managers: grain 256,
``v4.swa_kv`` pages of 64 tokens with a 128-token window (a checkpoint: two pages)."""

from __future__ import annotations

import numpy as np
from test_prefix import C4KV, C128KV, SWA, cat, decode, events_of, ids, make_manager, prefill


def start(mgr, rid: str, prompt: np.ndarray, outputs: np.ndarray) -> None:
    """Add and prefill ``prompt``, then decode ``outputs`` (all but the last fed back)."""
    mgr.add_request(rid, prompt, max_new_tokens=len(outputs) + 8)
    prefill(mgr, rid, len(prompt))
    decode(mgr, rid, outputs)
    mgr.check_invariants()  # the held pages' references counted


def test_decode_publishes_its_blocks_and_checkpoint_at_free():
    """600-token prompt, 1,000 tokens decoded: the prefill's commit publishes 256 and 512 (the latest
    checkpoint, no prompt checkpoints); decoding crosses 768 .. 1,536, each checkpoint held in place of the
    last, nothing published; ``free`` (1,599 committed) publishes the blocks 768 .. 1,536 and the terminal."""
    mgr, prompt, outputs = make_manager(), ids(1, 600), ids(2, 1000)
    start(mgr, "a", prompt, outputs)
    early = mgr.prefix.drain_events()
    assert events_of(early, "stored", C4KV) == events_of(early, "stored", C128KV) == [256, 512]
    assert events_of(early, "stored", SWA) == [512]
    # While "a" runs, its generated blocks give no hit: a request that continues its text hits at 512.
    follow_up = cat(prompt, outputs[:-1], ids(3, 40))
    assert mgr.add_request("b", follow_up, max_new_tokens=1).hit_tokens == 512
    mgr.free("b")
    mgr.free("a")
    mgr.check_invariants()
    late = mgr.prefix.drain_events()
    assert events_of(late, "stored", C4KV) == [768, 1024, 1280, 1536]
    assert events_of(late, "stored", SWA) == [1536]
    assert events_of(late, "removed", SWA) == []  # 512 stays: b's terminal (its hit), a lets go of its hold
    assert mgr.add_request("c", follow_up, max_new_tokens=1).hit_tokens == 1536
    mgr.check_invariants()


def test_a_held_checkpoint_is_one_reference_on_each_of_its_pages():
    """At 1,100 computed tokens (1,024 crossed, held: pages 14 and 15 of ``v4.swa_kv``), the window
    holds pages 15 .. 17 live ([973, 1,100] after the next step's release): 4 distinct pages in use,
    page 15 twice; the checkpoint at 512 is idle (cached, not in use)."""
    mgr, prompt = make_manager(), ids(1, 600)
    start(mgr, "a", prompt, ids(2, 501))  # 500 fed back: 1,100 computed
    base, live = mgr.request_pages("a", SWA)
    assert (base, live.size) == (15, 3)
    assert mgr.stats()[SWA].used_pages == 4
    assert mgr.stats()[SWA].cached_pages == 2  # 512's checkpoint
    mgr.free("a")  # publishes its terminal, 1,024 (1,099 committed), from the held pages; 512 superseded
    assert mgr.stats()[SWA].used_pages == 0
    assert mgr.stats()[SWA].cached_pages == 2
    mgr.check_invariants()


def test_a_boundary_crossed_in_the_last_step_publishes_from_the_table():
    """Freed right after the step that reached 1,281 tokens (1,280 crossed, not yet held; 1,024 held):
    ``free`` publishes 1,280 from the live window and lets go of the held 1,024."""
    mgr, prompt, outputs = make_manager(), ids(1, 600), ids(2, 682)  # 681 fed back: 1,281 computed
    start(mgr, "a", prompt, outputs)
    mgr.prefix.drain_events()
    mgr.free("a")
    mgr.check_invariants()
    late = mgr.prefix.drain_events()
    assert events_of(late, "stored", SWA) == [1280]
    assert mgr.stats()[SWA].cached_pages == 2
    assert mgr.add_request("b", cat(prompt, outputs[:-1], ids(3, 9)), max_new_tokens=1).hit_tokens == 1280


def test_the_interval_policy_commits_its_boundaries_and_holds_the_others():
    """``"interval"`` (512) keeps checkpoints past the prompt at 1,024 and 1,536: decoding commits those
    crossings at the next step, with the blocks below them; 768 and 1,280 are held (and let go), never published."""
    mgr = make_manager(prompt_checkpoints=None, checkpoint_policy="interval", checkpoint_interval_tokens=512)
    start(mgr, "a", ids(1, 600), ids(2, 1000))
    events = mgr.prefix.drain_events()
    assert events_of(events, "stored", SWA) == [512, 1024, 1536]
    assert events_of(events, "stored", C4KV) == [256, 512, 768, 1024, 1280, 1536]
    mgr.free("a")
    mgr.check_invariants()
    assert events_of(mgr.prefix.drain_events(), "stored", SWA) == []  # 1,536 is its latest (1,599 committed)


def test_a_step_that_crosses_prompt_boundaries_too_commits_every_one():
    """600 prompt ids and 400 more appended, computed in one step: its crossings (256, 512 inside the prompt, 768
    past it) commit at the next step as a prefill's do: the prompt checkpoints and 768, the latest."""
    mgr = make_manager(prompt_checkpoints=True)
    mgr.add_request("a", ids(1, 600), max_new_tokens=500)
    mgr.append_token_ids("a", ids(2, 400))
    mgr.schedule([("a", 1000)])
    mgr.append_token_ids("a", [5])
    mgr.schedule([("a", 1)])
    events = mgr.prefix.drain_events()
    assert events_of(events, "stored", SWA) == [256, 512, 768]
    assert events_of(events, "stored", C4KV) == [256, 512, 768]
    mgr.check_invariants()


def test_a_chunk_from_inside_the_prompt_that_crosses_past_it_commits_its_prompt_checkpoint():
    """1,000-token prompt prefilled to 512 (committed: a grain done), 400 ids appended, one step to 1,400: it crosses
    768 (inside the prompt) and 1,024 and 1,280 (past it), so it commits at the next step and 768's window is
    published while live (a hold of 1,280 alone would leave 768 to ``free``, its window gone)."""
    mgr, prompt, extra = make_manager(prompt_checkpoints=True), ids(1, 1000), ids(2, 400)
    mgr.add_request("a", prompt, max_new_tokens=1000)
    mgr.schedule([("a", 512)])
    mgr.append_token_ids("a", extra)
    mgr.schedule([("a", 888)])
    decode(mgr, "a", ids(3, 2))  # the next step: 768 commits
    mgr.free("a")
    mgr.check_invariants()
    assert events_of(mgr.prefix.drain_events(), "stored", SWA) == [256, 512, 768, 1280]
    assert mgr.add_request("b", cat(prompt, extra[:30]), max_new_tokens=1).hit_tokens == 768
    mgr.check_invariants()
