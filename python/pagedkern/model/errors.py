"""The one exception every model-loading failure raises."""

from __future__ import annotations

import os


class ModelLoadError(Exception):
    """A model could not be loaded: bad path, truncated or corrupted file, unsupported
    architecture, missing tensor or mismatched shape. `source` names the file (or folder, or
    spec) and `problem` says what is wrong with it."""

    def __init__(self, source: str | os.PathLike, problem: str):
        self.source = os.fspath(source)
        self.problem = problem
        super().__init__(f"cannot load model from {self.source}: {problem}")
