"""`pagedkern-serve` (`main`; run it as `python -m pagedkern.serving.cli` too): the command
line's modes in `cli.main`, its flags in `cli.args` (their value checks in `cli.value_checks`),
the configuration they make in `cli.config_from_flags`."""

from .main import main

__all__ = ["main"]
