"""Errors a user's input or files cause, as opposed to bugs.

`seekforge <verb>` prints a UserError as one line (what, which file or value, the fix) and exits 2; a
bug keeps its traceback. UserError is a ValueError, so docs/STYLE.md's "ValueError with the fix" and
every existing `except ValueError` keep working.
"""

from __future__ import annotations

from pathlib import Path


class UserError(ValueError):
    """Bad user input or a bad user file; the message names it and says what to do."""


class InvalidSetting(UserError):
    """One setting's value is out of its range; `name` is the setting (the server reports it as OpenAI's `param`)."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(message)


class CorruptFileError(UserError):
    """A file on disk is damaged, truncated or not what its name says; `path` and `reason` say how."""

    def __init__(self, path: str | Path, reason: str, fix: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}; {fix}")
