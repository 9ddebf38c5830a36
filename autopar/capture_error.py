"""The error capture raises (its own module: the recorder, the functionalization helpers and capture() raise it)."""


class CaptureError(RuntimeError):
    """The model could not be captured as a static graph; the message names the module and op at fault."""
