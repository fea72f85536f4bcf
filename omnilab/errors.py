"""Exception types. Every one is a ``ValueError`` (or ``RuntimeError``) subclass whose message names
the offending field and the accepted values, so notebook users can act on it directly."""


class OmnilabError(Exception):
    """Base class for omnilab errors."""


class ConfigError(OmnilabError, ValueError):
    """A checkpoint or profile configuration is missing a key or has the wrong geometry."""


class CheckpointError(OmnilabError, ValueError):
    """A checkpoint directory or hub id cannot be resolved or is missing a required file."""


class InputError(OmnilabError, ValueError):
    """A synthesis request has an invalid field (text, speaker, language, sampling values, ...)."""


class UnsupportedError(OmnilabError, ValueError):
    """An option that exists elsewhere (GPU devices, sleep mode, ...) is not supported here."""


class WorkerError(OmnilabError, RuntimeError):
    """A stage worker process died or stopped answering."""
