"""The exception tree of engramkv. Every error the library raises on purpose is one of these.

    EngramError
    ├── ConfigError            a knob has an invalid value or the knobs contradict each other
    ├── ModelLoadError         the model or its tokenizer cannot be loaded (missing, unsupported, offline)
    ├── InputError             the text given to ingest or ask cannot be used
    │   └── EmptyInputError    the input holds no tokens at all
    ├── SessionError           the session cannot do what was asked in its current state
    ├── WorkerError            a sharded ingest's worker failed beyond its retries (the last commit stands)
    └── StoreError             a persistent store cannot be opened, read or written
        ├── StoreLockedError   another process holds the store open for writing
        ├── StoreMismatchError the store was written by another model (or another format)
        ├── StoreCorruptError  a checksum or a cross-check between catalog and files failed
        ├── StoreFullError     the disk filled up; the store stays at its last commit
        ├── ReadOnlyError      a write was asked of a store opened read-only
        └── NamespaceError     a namespace name is invalid or unknown
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


class WorkerError(EngramError):
    """A sharded ingest's worker failed (or died more often than `shards.max_retries` allows)."""


class StoreError(EngramError):
    """A persistent store cannot be opened, read or written."""


class StoreLockedError(StoreError):
    """Another process has the store open for writing (one writer at a time; readers are fine)."""


class StoreMismatchError(StoreError):
    """The store was written by another model or in another format, and cannot serve this one."""


class StoreCorruptError(StoreError):
    """A checksum failed, or the catalog and the files on disk disagree beyond what recovery repairs."""


class StoreFullError(StoreError):
    """The disk is full; nothing after the last commit was kept."""


class ReadOnlyError(StoreError):
    """A write was asked of a store (or namespace) opened read-only."""


class NamespaceError(StoreError, ValueError):
    """A namespace name is invalid (it could escape the store directory) or does not exist."""
