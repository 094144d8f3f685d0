"""``python -m core.rl.reward_check SPEC``: the submit's check of ``rl.reward``, in a process of
its own (the login node's CLI never imports the user's module, nor what it imports: torch...).

Loads the reward as the controller's reward processes will (core.rl.rewards.load: the module
found, compiled and imported, the function there and callable; math-verify installed for
``math``). Exit 0 when it loads; else the one-line ConfigError on stderr and exit 2.
"""
from __future__ import annotations

import sys

from core.errors import ConfigError, ExitCode
from core.rl import rewards


def main(argv: list[str]) -> int:
    """Load ``argv[0]``; the exit code."""
    if len(argv) != 1:
        print("usage: python -m core.rl.reward_check SPEC", file=sys.stderr)
        return ExitCode.USER_ERROR
    try:
        rewards.load(argv[0], "rl.reward")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return ExitCode.USER_ERROR
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
