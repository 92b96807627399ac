"""One exception type for bad user input, so entry points can print it in one line."""


def brief(error: BaseException, limit: int = 300) -> str:
    """An exception in one line for a message: its type and the first `limit` characters of
    its first line."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0][:limit] if text else ''}"


class UserInputError(ValueError):
    """Bad flags, files or rows. The message names the flag, file or row at fault."""


class TrainingHalted(RuntimeError):
    """Training stopped on purpose (e.g. too many non-finite losses in a row); the message
    says why and where the last good checkpoint is. Entry points exit 3."""


class FinalSaveFailed(RuntimeError):
    """Writing a run's final models failed; the trained state was saved as a checkpoint
    first and the message says how to get the models from it. Entry points exit 4."""
