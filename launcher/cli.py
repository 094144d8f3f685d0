"""``baton``: the command line. Parse, dispatch to one command module, map errors to exits.

Exit codes (core.errors.ExitCode): OK, FAILED (the run or a check failed), USER_ERROR (bad
input: config, arguments, files; one line on stderr, a traceback only with --debug),
INTERRUPTED. A storage fault that retries did not get past (a TransientIOError: the filesystem
failed reading a checkpoint) is one line too, with FAILED: the input is right, a later try may work. An argument argparse refuses is the same one line:
``baton: error: <message>; see baton <command> --help``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from core.config.schema import escaped
from core.errors import ExitCode, TransientIOError, UserError
from launcher import (
    cmd_cancel,
    cmd_ckpt,
    cmd_data,
    cmd_doctor,
    cmd_export,
    cmd_logs,
    cmd_plan,
    cmd_report,
    cmd_status,
    cmd_submit,
    cmd_sweep,
)

COMMANDS = [cmd_submit, cmd_plan, cmd_status, cmd_logs, cmd_cancel, cmd_ckpt, cmd_data, cmd_export, cmd_sweep, cmd_report, cmd_doctor]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: exit 2, one line with the help hint
        self.exit(ExitCode.USER_ERROR, f"baton: error: {escaped(message)}; see {escaped(self.prog)} --help\n")


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command ``args`` holds (``baton sweep submit``), for its --help hint."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return _command_parser(chosen, args)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="baton",
        description="Launch Megatron-core training on Slurm: one controller, many workers.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come after options (`submit x.yaml --backend local a.b=1`); one
    # without "=" is then the override error it is before the options, not an unknown argument.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if stray:
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s")
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if args.debug:
            raise
        print(f"baton: error: {escaped(str(exc))}", file=sys.stderr)  # one line, whatever a value held
        return ExitCode.USER_ERROR
    except TransientIOError as exc:
        if args.debug:
            raise
        print(f"baton: error: {escaped(str(exc))}", file=sys.stderr)
        return ExitCode.FAILED
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `baton logs ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
