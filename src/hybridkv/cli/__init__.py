"""The ``hybridkv`` command line.

Each subcommand lives in its own module exposing ``register(subparsers)``, which
adds its parser and sets ``run=<callable(args) -> int>`` as a default. Only the
module of the subcommand being run is imported (the others get a one-line stub
for ``--help``), so ``hybridkv --help`` and ``hybridkv plan`` start fast. Adding a
subcommand is one entry in ``COMMANDS``.

Errors: every failure is one line on stderr, ``hybridkv: error: ...``, with exit
status 2 (bad input, a file that cannot be read or written, a limit reached);
a subcommand's own verdict keeps its status (``verify`` exits 1 on FAIL).
``hybridkv`` with no subcommand prints the help on stderr and exits 2. Set
``HYBRIDKV_TRACEBACK=1`` to see the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence

from hybridkv import __version__

# name -> (module, one-line help shown by `hybridkv --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("hybridkv.cli.plan_cmd", "split a KV memory budget over a model's cache groups"),
    "simulate": ("hybridkv.cli.simulate_cmd", "run a serving workload through the cache manager"),
    "verify": (
        "hybridkv.cli.verify_cmd",
        "prove the cache end to end: reference attention through pages vs dense",
    ),
}
COMMAND_MODULES: tuple[str, ...] = tuple(module for module, _ in COMMANDS.values())
# Said on a terminal before a command that prints nothing for a while.
SLOW_START = {"verify": "running the reference attention paged and dense (10-25 s)..."}

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
MAX_MESSAGE_CHARS = 400


class UsageError(Exception):
    """Bad command-line input; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # "argument --x: --x must be ..." -> "--x must be ..." (our types name their flag)
        match = re.match(r"argument ([^:]+): (.*)", message, re.S)
        if match and match.group(2).startswith(match.group(1).split("/")[0]):
            message = match.group(2)
        raise UsageError(message)


def _selected_command(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is not an option)."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` gets its full arguments
    (``argv=None``: every subcommand, importing each module)."""
    parser = _Parser(
        prog="hybridkv",
        description="Paged KV cache planning and tools for hybrid-attention LLMs (DeepSeek-V4).",
    )
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    selected = _selected_command(argv) if argv is not None else None
    for name, (module_name, help_text) in COMMANDS.items():
        if argv is None or name == selected:
            importlib.import_module(module_name).register(subparsers)
        else:
            subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, (UsageError, ValueError)):
        text = str(exc)
    elif isinstance(exc, RecursionError):
        text = "input nested too deeply to read (JSON nesting or a cycle)"
    elif isinstance(exc, MemoryError):
        text = "out of memory: the request is too large for this machine (lower the sizes)"
    elif isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else ""
        if isinstance(where, str) and len(where) > 80:
            where = where[:77] + "..."
        text = f"{where}: {exc.strerror or exc}" if where else (exc.strerror or str(exc))
    else:
        text = f"unexpected {type(exc).__name__}: {exc} (set HYBRIDKV_TRACEBACK=1 for details)"
    text = " ".join(text.split())
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    return text


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (never raises)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        run = getattr(args, "run", None)
        if run is None:
            if args.command is not None:  # a stub: the selection missed it
                return main([args.command, "--help"])
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        if args.command in SLOW_START and sys.stderr.isatty():
            print(f"hybridkv {args.command}: {SLOW_START[args.command]}", file=sys.stderr, flush=True)
        return int(run(args) or 0)
    except SystemExit as exc:  # --help / --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BrokenPipeError:  # e.g. `hybridkv plan --json | head`
        _silence_stdout()
        return 1
    except KeyboardInterrupt:
        print("hybridkv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the one place every failure becomes one line
        if os.environ.get("HYBRIDKV_TRACEBACK") == "1":
            raise
        print(f"hybridkv: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
