"""What the command-line tools share: one-line argument errors and output paths checked first."""
from __future__ import annotations

import argparse
import os


class CliParser(argparse.ArgumentParser):
    """An argument parser whose errors (an unknown option, a bad value) are one line,
    ``kvcanary: COMMAND: ...``, followed by the usage, with exit status 2."""

    def __init__(self, *args, command: str, **kw):
        super().__init__(*args, **kw)
        self.command = command

    def error(self, message: str):
        self.exit(2, f"kvcanary: {self.command}: {message}\n{self.format_usage()}")


def output_path_problem(path: str) -> str | None:
    """Why a file cannot be written or appended to at ``path`` (None: it can): checked before
    any work, so that a typo in a folder name fails at once, not after the work.

    Example::

        >>> from kvcanary_cupy.cli import output_path_problem
        >>> output_path_problem("/nonexistent-folder/plot.png")
        'its folder /nonexistent-folder does not exist'
    """
    if not path:
        return "the path is empty"
    if os.path.isdir(path):
        return "that is a folder"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(folder):
        return f"its folder {folder} does not exist"
    if not os.path.isdir(folder):
        return f"{folder} is not a folder"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "that file is not writable"
    if not os.path.exists(path) and not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {folder} is not writable"
    return None
