"""The exception tree of engramkv. Every error the library raises on purpose is one of these.

    EngramError
    ├── ConfigError            a knob has an invalid value or the knobs contradict each other
    ├── ModelLoadError         the model or its tokenizer cannot be loaded (missing, unsupported, offline)
    ├── InputError             the text given to ingest or ask cannot be used
    │   └── EmptyInputError    the input holds no tokens at all
    └── SessionError           the session cannot do what was asked in its current state
"""

from __future__ import annotations


class EngramError(Exception):
    """Base class of every error engramkv raises on purpose."""


class ConfigError(EngramError, ValueError):
    """A configuration value is invalid or inconsistent with the model."""


class ModelLoadError(EngramError):
    """The model or tokenizer could not be loaded."""


class InputError(EngramError, ValueError):
    """The input text cannot be used (wrong type, undecodable, ...)."""


class EmptyInputError(InputError):
    """The input holds no tokens."""


class SessionError(EngramError):
    """The session cannot perform the operation in its current state."""
