"""Makes packages unimportable, to rehearse a machine that lacks them: with this folder on
PYTHONPATH, every top-level name listed in $PAGEDKERN_BLOCK_IMPORTS (comma-separated) raises
ModuleNotFoundError on import, exactly as on a machine where it is not installed. Used by the
GPU-check rehearsal (the GPU image lacks the HTTP stack and gguf) and by the CuPy GPU test
(no torch). Python imports `sitecustomize` at start-up from the first folder on sys.path that
holds one."""

from __future__ import annotations

import os
import sys

BLOCK_ENV = "PAGEDKERN_BLOCK_IMPORTS"


class BlockedImports:
    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)
        return None


def install() -> BlockedImports | None:
    names = {n.strip() for n in os.environ.get(BLOCK_ENV, "").split(",") if n.strip()}
    if not names:
        return None
    loaded = sorted(n for n in names if n in sys.modules)
    if loaded:  # a blocked package imported before this hook would make the rehearsal a lie
        raise RuntimeError(f"{BLOCK_ENV}: {loaded} already imported at start-up")
    finder = BlockedImports(names)
    sys.meta_path.insert(0, finder)
    return finder


def chain() -> None:
    """Runs the sitecustomize this one shadows, if any (an image may rely on its own)."""
    import runpy

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or "."), "sitecustomize.py")
        if os.path.dirname(candidate) != here and os.path.isfile(candidate):
            runpy.run_path(candidate, run_name="sitecustomize")
            return


install()
chain()
