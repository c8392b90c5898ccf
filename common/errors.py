"""The one exception type for bad user input."""


class InputError(ValueError):
    """Bad input found before training: the message names the problem and the fix."""
