"""The ``hybridkv`` command line.

Each subcommand lives in its own module exposing ``register(subparsers)``, which
adds its parser and sets ``run=<callable(args) -> int>`` as a default. Adding a
subcommand is one line in ``COMMAND_MODULES``.

Errors: bad input raises ``ValueError`` (or an argparse error) and is printed as
one line, ``hybridkv: error: ...``, on stderr with exit status 2. ``hybridkv``
with no subcommand prints the help on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from hybridkv import __version__

COMMAND_MODULES: tuple[str, ...] = (
    "hybridkv.cli.plan_cmd",
    "hybridkv.cli.simulate_cmd",
    "hybridkv.cli.verify_cmd",
)

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command-line input; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hybridkv",
        description="Paged KV cache planning and tools for hybrid-attention LLMs (DeepSeek-V4).",
    )
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (never raises for bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        run = getattr(args, "run", None)
        if run is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return int(run(args) or 0)
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BrokenPipeError:  # e.g. `hybridkv plan --json | head`
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except (UsageError, ValueError) as exc:
        message = " ".join(str(exc).split())
        print(f"hybridkv: error: {message}", file=sys.stderr)
        return EXIT_USAGE
