"""Peer cache managers driven as lines of ``bench/hit_sweep.py`` (issue 21).

One module per peer; each imports its peer only inside itself, and each has a
``load_*`` function that returns the side class, or a sentence saying why the
peer is not importable here. bench/README.md has the environments.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence

# line name -> "module:loader"; a loader returns the side class or why it is not importable.
PEER_LINES = {
    "tokenspeed 0.1.30": "peers.tokenspeed_side:load_tokenspeed_side",
    "SGLang 0.5.23": "peers.sglang_side:load_sglang_side",
}


def peer_unavailable(packages: Sequence[str], distribution: str, speaks: str, load: Callable[[], object],
                     what: str) -> str | None:
    """Why a peer side cannot be driven in this Python, as a sentence; None when it can:
    each of ``packages`` is importable, ``distribution`` is installed at the version the
    side ``speaks``, and ``load()`` (stand-ins, then the peer's modules) raises no
    ImportError (``what`` names what did not import)."""
    for package in packages:
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed (bench/README.md: the peers environment)"
    from importlib.metadata import version

    if (found := version(distribution)) != speaks:
        return f"{distribution} {found} installed; this side speaks {speaks}"
    try:
        load()
    except ImportError as exc:
        return f"{what} not import: {exc}"
    return None


@functools.cache
def load_peer_side(line: str) -> type | str:
    """The side class of a peer line, or a sentence saying why it cannot run here."""
    import importlib

    module, loader = PEER_LINES[line].split(":")
    return getattr(importlib.import_module(module), loader)()


def peer_lines_skipped(lines: list[str]) -> dict[str, str]:
    """The peer lines among ``lines`` that cannot run in this Python, with the reason."""
    loaded = {line: load_peer_side(line) for line in lines if line in PEER_LINES}
    return {line: side for line, side in loaded.items() if isinstance(side, str)}
