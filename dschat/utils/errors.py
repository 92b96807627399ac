"""One exception type for bad user input, so entry points can print it in one line."""


class UserInputError(ValueError):
    """Bad flags, files or rows. The message names the flag, file or row at fault."""
