"""The one error type that run.py turns into a one-line message instead of a traceback, and the one warning type
that the entry points print as one `selfspec: warning:` line."""

import warnings


class SelfspecError(ValueError):
    """Bad input (config value, skip set, prompt, model path): the message names the value and what is allowed."""


class SelfspecWarning(UserWarning):
    """Something a run got past (a torn last line skipped): the message says what and where."""


_python_formatwarning = warnings.formatwarning


def format_warning(message, category, filename, lineno, line=None) -> str:
    """A SelfspecWarning as `selfspec: warning: <message>`, without Python's source path; others as Python has them."""
    if issubclass(category, SelfspecWarning):
        return f"selfspec: warning: {message}\n"
    return _python_formatwarning(message, category, filename, lineno, line)


def print_warnings_as_lines() -> None:
    """At an entry point (run.py's task, python -m selfspec.summarize, ...): SelfspecWarnings print as one line."""
    warnings.formatwarning = format_warning
