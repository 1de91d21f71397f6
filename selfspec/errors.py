"""The one error type that run.py turns into a one-line message instead of a traceback."""


class SelfspecError(ValueError):
    """Bad input (config value, skip set, prompt, model path): the message names the value and what is allowed."""
