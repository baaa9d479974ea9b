"""User-facing errors. Each says what went wrong and what to do; the CLI prints one line and exits 2."""


class SpecterError(Exception):
    """Base class of every error a user can cause (bad input, missing files, impossible budgets)."""


class CheckpointError(SpecterError):
    """The model directory is missing, incomplete, corrupt or not in a supported format."""


class UnsupportedModelError(SpecterError):
    """The checkpoint's architecture is not one Specter implements."""


class ConfigError(SpecterError):
    """An invalid argument: sampling values, budgets, devices, policy names."""


class ContextLengthError(SpecterError):
    """Prompt plus requested tokens do not fit the model's context."""


class BudgetError(SpecterError):
    """A memory budget too small to run (cannot hold one layer's top-k experts)."""


class TokenizerError(SpecterError):
    """A string prompt for a checkpoint that ships no tokenizer (pass token ids instead)."""


class NotAvailableError(SpecterError):
    """A feature that exists in the API but not in this build yet."""
