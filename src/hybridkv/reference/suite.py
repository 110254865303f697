"""The scenarios behind ``hybridkv verify``, in order, with progress lines.

Default: the fixed script at the small geometry (window 16, head_dim 128: many
window and entry boundaries per token) and the pressure scenario at DeepSeek-V4's
production cache geometry (window 128, head_dim 512 = 7 FP8 tiles + rope 64).
``scenarios`` random workloads (seeds ``seed + 1 ..``) follow at the production
geometry.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridkv.reference.config import ReferenceConfig
from hybridkv.reference.pressure import run_pressure_scenario, run_random_scenario
from hybridkv.reference.runner import VerifyReport
from hybridkv.reference.scenario import run_verify_scenario

SMALL_GEOMETRY = ReferenceConfig()
PRODUCTION_GEOMETRY = ReferenceConfig(head_dim=512, window_tokens=128)


def geometry_label(config: ReferenceConfig) -> str:
    return (f"window {config.window_tokens}, head_dim {config.head_dim} (rope {config.rope_dim}), layer ratios "
            f"{list(config.layer_ratios)}, index top-k {config.index_topk}")


def run_verify_suite(
    seed: int = 0, scenarios: int = 0, *, fault: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[tuple[str, ReferenceConfig, VerifyReport]]:
    """Run every scenario; ``(title, geometry, report)`` each."""
    say = progress or (lambda _msg: None)
    out = []
    say(f"[1/{2 + scenarios}] scripted scenario ({geometry_label(SMALL_GEOMETRY)}) ...")
    out.append(("scripted scenario", SMALL_GEOMETRY, run_verify_scenario(seed, fault=fault, progress=say)))
    say(f"[2/{2 + scenarios}] pressure scenario ({geometry_label(PRODUCTION_GEOMETRY)}) ...")
    out.append(("pressure scenario", PRODUCTION_GEOMETRY,
                run_pressure_scenario(seed, config=PRODUCTION_GEOMETRY, progress=say)))
    for k in range(scenarios):
        say(f"[{3 + k}/{2 + scenarios}] random scenario, seed {seed + 1 + k} ...")
        out.append((f"random scenario (seed {seed + 1 + k})", PRODUCTION_GEOMETRY,
                    run_random_scenario(seed + 1 + k, config=PRODUCTION_GEOMETRY, progress=say)))
    return out
