"""The one error type for bad input: jobs print it as a single line and exit non-zero."""


class InputError(ValueError):
    """Input that cannot be processed: the message names the file, column or value."""


def one_line(error: BaseException | str) -> str:
    """An error's message folded onto one line (Arrow, OS and CUDA errors can span several;
    job logs are read one line per failure); the error's type name when it has no message."""
    text = " ".join(str(error).split())
    if not text and isinstance(error, BaseException):
        return type(error).__name__
    return text
