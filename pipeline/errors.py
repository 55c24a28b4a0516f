"""The one error type for bad input: jobs print it as a single line and exit non-zero."""


class InputError(ValueError):
    """Input that cannot be processed: the message names the file, column or value."""
