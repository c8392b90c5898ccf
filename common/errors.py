"""The one exception type for bad user input."""


class InputError(ValueError):
    """Bad input found before training: the message names the problem and the fix."""


class Interrupted(KeyboardInterrupt):
    """The stop button ended something and said what: IPython shows this message in place of a traceback (its
    ``_render_traceback_`` hook), since a traceback into the project's code would tell the person nothing more."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]
