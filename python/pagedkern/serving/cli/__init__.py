"""`pagedkern-serve` (`main`; run it as `python -m pagedkern.serving.cli` too): the command
line's modes in `cli.main`, its flags and their checks in `cli.args`."""

from .main import main

__all__ = ["main"]
