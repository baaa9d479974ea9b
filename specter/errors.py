"""User-facing errors. Each says what went wrong and what to do; the CLI prints one line and exits 2."""


class SpecterError(Exception):
    """Base class of every error a user can cause (bad input, missing files, impossible budgets)."""


class CheckpointError(SpecterError):
    """The model directory is missing, incomplete, corrupt or not in a supported format."""


class UnsupportedModelError(SpecterError):
    """The checkpoint's architecture is not one Specter implements."""


class ConfigError(SpecterError, ValueError):
    """An invalid argument: sampling values, budgets, devices, policy names (a ValueError too, as Python's
    own bad arguments are)."""


class ContextLengthError(SpecterError):
    """Prompt plus requested tokens do not fit the model's context."""


class BudgetError(SpecterError):
    """A memory budget too small to run (cannot hold one layer's top-k experts)."""


class TokenizerError(SpecterError):
    """A string prompt for a checkpoint that ships no tokenizer (pass token ids instead)."""


class NotAvailableError(SpecterError):
    """A feature that exists in the API but not in this build yet."""


class SpecterWarning(UserWarning):
    """Something a user should know that does not stop the work (a cache that cannot be written, sampling
    arguments that change nothing). The CLI prints it as one line, as it prints an error."""


def warn(message: str) -> None:
    """A SpecterWarning attributed to the first frame outside this package: the caller's own line, however
    deep inside Specter it was found."""
    import os
    import sys
    import warnings

    here, frame, level = os.path.dirname(os.path.abspath(__file__)) + os.sep, sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, SpecterWarning, stacklevel=level + 1)
