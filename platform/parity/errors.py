"""Errors a user can act on; the CLI prints their message without a traceback."""


class ParityError(RuntimeError):
    """A run cannot proceed; the message names the key, file or row at fault."""


class DataError(ParityError, ValueError):
    """A dataset row or file is malformed; the message names the file and row."""


class PrecisionConfigError(ParityError, ValueError):
    """A precision setting or the quantized checkpoint's config file is wrong; the message names it."""


class ConfigError(ValueError):
    """A config value is out of range or conflicts with another; the message names the key."""
