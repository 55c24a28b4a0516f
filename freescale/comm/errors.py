"""The comm layer's error, importable without torch (the jobs' error handling reads it)."""


class BackendUnavailable(RuntimeError):
    """The chosen comm backend cannot run here; the message is one line naming what is missing."""
