"""Typed errors of the control path. The data path never raises: it returns per-page success.

Each error carries the exit code `sglang-offload` ends with (`exit_code`): 2 for bad input (a
value, option or config key the user can fix; the message names it and the fix), 1 for a run
that could not complete on this machine (a store that cannot be opened, a server that does not
answer, a path that cannot work here). `offload.cli.main` prints the message as `error:` lines.
"""


class OffloadError(Exception):
    """Base of every error this package raises on purpose (bad input unless a subclass says)."""

    exit_code = 2


class UsageError(OffloadError):
    """A command-line value is wrong or two options conflict: the message names the option."""


class ConfigError(OffloadError):
    """A configuration value is wrong. `problems` lists one line per bad key."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class RunError(OffloadError):
    """The command could not complete (exit 1): the message says what failed and what to do."""

    exit_code = 1


class StoreError(RunError):
    """The block store cannot be opened or used (not a per-block failure)."""


class DetectError(OffloadError):
    """Hardware detection cannot run (e.g. the root directory is missing): bad input."""


class PathUnavailableError(RunError):
    """An explicitly requested transfer path cannot work on this machine."""
