"""Typed errors of the control path. The data path never raises: it returns per-page success."""


class OffloadError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(OffloadError):
    """A configuration value is wrong. `problems` lists one line per bad key."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class StoreError(OffloadError):
    """The block store cannot be opened or used (not a per-block failure)."""


class DetectError(OffloadError):
    """Hardware detection cannot run (e.g. the root directory is missing)."""


class PathUnavailableError(OffloadError):
    """An explicitly requested transfer path cannot work on this machine."""
