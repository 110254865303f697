"""``hybridkv verify --tier``: a prefix offloaded by one instance, hit from a tier by another.

Instance A (its own manager and page ids) computes a prompt with the reference
layers and offloads its blocks and checkpoints at 256 and 512 tokens to the
tier. Instance B (another manager, other page ids) plans a load of a prompt
sharing 600 tokens, loads what the tier serves, computes the rest and a few
decode tokens on top, and every output is compared with the dense reference.
Then the faults: a missing block (a shorter hit), a corrupted block (a clean
miss, a counted error) and, for Mooncake, a dead master (a miss, an error);
every output stays correct and nothing raises.

For ``disk`` and ``mooncake`` A runs in a child process (spawned) and B in
this one; host memory cannot cross processes, so for ``host`` both run here
with separate managers. Mooncake: a master on loopback is started and stopped
here, and A's process stays alive (it holds the segment its objects live in)
until B is done.
"""

from __future__ import annotations

import multiprocessing
import tempfile
import time
from collections.abc import Callable

import numpy as np

from hybridkv.models.layout import cache_layout
from hybridkv.reference.config import ReferenceConfig
from hybridkv.reference.dense import dense_forward
from hybridkv.reference.runner import TOLERANCE, CheckResult, VerifyReport, build_runner
from hybridkv.tiers import DiskTier, HostTier, ObjectStore, group_pools_from_layers
from hybridkv.transfer import LoadPlan, pages_from_manager, pages_from_step, plan_prefix_load, plan_prefix_offload

TIERS = ("host", "disk", "mooncake")
PROMPT_TOKENS = 700
SHARED_TOKENS = 600
CHECKPOINTS_AT = (256, 512)
TAIL_TOKENS = 4
LAYOUT = cache_layout(ReferenceConfig().hf_config(), speculative_tokens=3)


def _prompts(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A's prompt, B's prompt (sharing ``SHARED_TOKENS``) and B's decode tokens."""
    rng = np.random.default_rng(seed + 2_000_003)
    vocab = ReferenceConfig().vocab_size
    prompt = rng.integers(0, vocab, PROMPT_TOKENS)
    other = np.concatenate([prompt[:SHARED_TOKENS], rng.integers(0, vocab, 50)])
    return prompt, other, rng.integers(0, vocab, TAIL_TOKENS)


def _make_store(spec: dict):
    """An ObjectStore over the tier ``spec`` names, and the tier itself."""
    if spec["kind"] == "host":
        tier = spec.get("tier") or HostTier(1 << 30)
    elif spec["kind"] == "disk":
        tier = DiskTier(spec["root"])
    else:
        from hybridkv.tiers.mooncake import MooncakeTier

        tier = MooncakeTier(spec["master_address"], spec["metadata_url"], segment_bytes=64 << 20)
    return ObjectStore(tier, LAYOUT), tier


def offload(store: ObjectStore, seed: int) -> int:
    """Instance A: compute the prompt and offload it; the objects stored."""
    prompt, _, _ = _prompts(seed)
    a = build_runner(seed=seed, shuffle_seed=seed + 3)
    a.manager.add_request("a", prompt, max_new_tokens=8)
    batch = a.manager.schedule([("a", prompt.size)])
    a.stack.forward(batch, prompt)
    plan = plan_prefix_offload(store, prompt, prompt.size, pages_from_step(batch, "a"), checkpoints_at=list(CHECKPOINTS_AT))
    return sum(plan.run(store, group_pools_from_layers(LAYOUT, a.stack.pools)))


def _instance_a(spec: dict, seed: int, conn) -> None:
    """Child process entry: offload, report, and hold the tier open until told to stop."""
    try:
        store, tier = _make_store(spec)
        conn.send(("ok", offload(store, seed)))
        conn.recv()
        close = getattr(tier, "close", None)
        if close is not None:
            close()
    except Exception as exc:  # reported to the parent as a failed offload
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def hit(store: ObjectStore, seed: int, shuffle_seed: int) -> tuple[int, int, float]:
    """Instance B: (planned, loaded) hit tokens and the max |paged - dense| over every token
    B computed (the prompt past the hit and ``TAIL_TOKENS`` decode steps)."""
    _, other, tail = _prompts(seed)
    b = build_runner(seed=seed, shuffle_seed=shuffle_seed, enable_prefix_caching=False)
    plan = plan_prefix_load(store, other)
    got = _load(b, store, plan, other)
    if got < plan.boundary_tokens:  # the load fell back: admit again with pages for what arrived
        b.manager.free("b")
        got = _load(b, store, LoadPlan(tuple(o for o in plan.objects if _serves(o, got)), (got,) if got else ()), other)
    outs = [b.stack.forward(b.manager.schedule([("b", other.size - got)]), other[got:]).hidden]
    for token in tail:
        b.manager.append_token_ids("b", [token])
        outs.append(b.stack.forward(b.manager.schedule([("b", 1)]), np.array([token])).hidden)
    dense = dense_forward(b.model, np.concatenate([other, tail])).hidden[got:]
    return plan.boundary_tokens, got, float(np.max(np.abs(np.concatenate(outs) - dense)))


def _load(b, store: ObjectStore, plan: LoadPlan, prompt: np.ndarray) -> int:
    """Admit ``prompt``, give the planned hit pages (nothing computed) and load into them."""
    b.manager.add_request("b", prompt, max_new_tokens=8)
    if not plan.boundary_tokens:
        return 0
    b.manager.schedule([("b", plan.boundary_tokens)])
    pools = group_pools_from_layers(LAYOUT, b.stack.pools)
    return plan.run(store, pools, pages_from_manager(b.manager, "b")).boundary_tokens


def _serves(o, boundary: int) -> bool:
    """Whether resuming at ``boundary`` reads object ``o`` (a block below it, its checkpoint)."""
    return o.first_token < boundary if o.key.kind == "block" else o.boundary_tokens == boundary


def _hit_check(name: str, store: ObjectStore, seed: int, shuffle_seed: int, expect: Callable[[int, int], bool],
               what: str) -> CheckResult:
    """Run instance B; pass when ``expect(planned, loaded)`` holds and every output is within tolerance."""
    try:
        planned, got, err = hit(store, seed, shuffle_seed)
    except Exception as exc:  # an exception out of schedule or a load is the failure this looks for
        return CheckResult(name, False, detail=f"raised {type(exc).__name__}: {' '.join(str(exc).split())}")
    passed = expect(planned, got) and err <= TOLERANCE
    detail = f"planned {planned} hit tokens, loaded {got}; {what}"
    return CheckResult(name, passed, tokens=SHARED_TOKENS + 50 - got + TAIL_TOKENS, max_abs_error=err, detail=detail)


def _block(store: ObjectStore, seed: int, first_token: int):
    _, other, _ = _prompts(seed)
    plan = plan_prefix_load(store, other)
    return next(o.key for o in plan.objects if o.key.kind == "block" and o.first_token == first_token)


def _corrupt(store: ObjectStore, tier, key) -> bool:
    """Flip one bit in the middle of the stored object ``key`` (rewritten through the tier)."""
    name = store.name(key)
    raw = tier.get([name])[0]
    if raw is None:
        return False
    raw = bytearray(raw)
    raw[len(raw) // 2] ^= 1
    return _delete(tier, name) and tier.put([(name, bytes(raw))]) == [True]


def _delete(tier, name: str, timeout_s: float = 5.0) -> bool:
    """Delete ``name``, retrying while a read's lease still pins it (Mooncake)."""
    deadline = time.monotonic() + timeout_s
    while not tier.delete([name]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _fault_checks(store: ObjectStore, tier, seed: int) -> list[CheckResult]:
    checks = []
    missing = _block(store, seed, 256)
    _delete(tier, store.name(missing))
    checks.append(_hit_check("missing object -> shorter hit", store, seed, seed + 13,
                             lambda p, g: 0 < g < max(CHECKPOINTS_AT), f"block {missing.group_id} [256, 512) deleted"))
    corrupt_before = store.stats().corrupt
    ok = _corrupt(store, tier, _block(store, seed, 0))
    check = _hit_check("corrupted object -> clean miss", store, seed, seed + 17, lambda p, g: g == 0, "")
    counted = store.stats().corrupt - corrupt_before
    checks.append(CheckResult(check.name, check.passed and ok and counted >= 1, check.tokens, check.max_abs_error,
                              detail=f"{check.detail}one bit of block [0, 256) flipped; {counted} corrupt counted"))
    return checks


def _dead_master_check(store: ObjectStore, tier, master, seed: int) -> CheckResult:
    master.stop()
    errors_before = tier.stats().errors
    check = _hit_check("dead master -> clean miss", store, seed, seed + 19, lambda p, g: g == 0, "")
    errors = tier.stats().errors - errors_before
    return CheckResult(check.name, check.passed and errors >= 1, check.tokens, check.max_abs_error,
                       detail=f"{check.detail}master killed; {errors} tier errors counted")


def _start_a(spec: dict, seed: int):
    """Instance A in a spawned process: (process, pipe, objects stored or an error string)."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_instance_a, args=(spec, seed, child), daemon=True)
    process.start()
    status, value = parent.recv() if parent.poll(120) else ("error", "instance A did not answer in 120 s")
    return process, parent, (value if status == "ok" else str(value))


def _stop_a(process, conn) -> None:
    try:
        conn.send("stop")
    except OSError:
        pass
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join()


def run_tier_check(tier: str, seed: int = 0, progress: Callable[[str], None] | None = None) -> VerifyReport:
    """A offloads, B hits from ``tier`` (host, disk or mooncake); the faults after. See the module doc."""
    if tier not in TIERS:
        raise ValueError(f"--tier must be one of {', '.join(TIERS)}, got {tier!r}")
    say = progress or (lambda _: None)
    with tempfile.TemporaryDirectory(prefix="hybridkv-tier-") as root:
        if tier == "mooncake":
            from hybridkv.tiers.mooncake import MooncakeMaster, load_store_class

            load_store_class()  # TierUnavailable (what to install) before a master is started
            master = MooncakeMaster(log_path=f"{root}/master.log").start()
            try:
                spec = {"kind": tier, "master_address": master.master_address, "metadata_url": master.metadata_url}
                return _run(spec, seed, say, master)
            finally:
                master.stop()
        spec = {"kind": tier, "root": f"{root}/objects"}
        return _run(spec, seed, say, None)


def _run(spec: dict, seed: int, say: Callable[[str], None], master) -> VerifyReport:
    kind = spec["kind"]
    notes = []
    if kind == "host":
        store, tier = _make_store(spec)
        say("instance A (this process, its own manager) computes and offloads the prompt")
        stored, process, conn = offload(store, seed), None, None
        notes.append("host memory cannot cross processes: A and B are two managers in one process")
    else:
        say(f"instance A (a spawned process) computes and offloads the prompt to {kind}")
        process, conn, stored = _start_a(spec, seed)
        store, tier = _make_store(spec)
        notes.append("A and B are separate processes with their own managers and page ids")
    try:
        checks = [CheckResult("A offloads to the tier", isinstance(stored, int) and stored > 0,
                              detail=f"{stored} objects stored" if isinstance(stored, int) else f"failed: {stored}")]
        say("instance B (another manager, other page ids) hits the prefix from the tier")
        checks.append(_hit_check("B hits from the tier, paged == dense", store, seed, seed + 11,
                                 lambda p, g: g == p == max(CHECKPOINTS_AT), "the rest computed on top"))
        say("faults: a missing object, a corrupted object")
        checks += _fault_checks(store, tier, seed)
        if master is not None:
            _stop_a(process, conn)
            process = None
            say("fault: the Mooncake master killed")
            checks.append(_dead_master_check(store, tier, master, seed))
    finally:
        if process is not None:
            _stop_a(process, conn)
        close = getattr(tier, "close", None)
        if close is not None and master is None:
            close()
    return VerifyReport(tuple(checks), TOLERANCE, tuple(notes))


if __name__ == "__main__":  # pragma: no cover - a manual entry point
    import sys

    report = run_tier_check(sys.argv[1] if len(sys.argv) > 1 else "host", progress=print)
    for c in report.checks:
        print("PASS" if c.passed else "FAIL", c.name, c.max_abs_error, c.detail)
