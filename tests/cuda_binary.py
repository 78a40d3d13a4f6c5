"""Reads the machine code of the built extension with cuobjdump (+ nvdisasm for SASS), the pip
packages nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm or the CUDA toolkit: architectures,
per-kernel resource usage (registers, stack, local memory = spills) and per-kernel SASS."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def _tool_dirs() -> list[Path]:
    dirs = []
    spec = importlib.util.find_spec("nvidia")
    for location in (spec.submodule_search_locations or []) if spec else []:
        dirs += sorted(Path(location).glob("cu*/bin"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "bin")
    dirs.append(Path("/usr/local/cuda/bin"))
    return dirs


def find_tool(name: str) -> Path:
    for d in _tool_dirs():
        if (d / name).is_file():
            return d / name
    found = shutil.which(name)
    if found:
        return Path(found)
    raise FileNotFoundError(
        f"{name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
    )


@dataclass(frozen=True, slots=True)
class Resources:
    registers: int
    stack: int
    local: int
    shared: int


class CudaBinary:
    def __init__(self, path: str) -> None:
        self.path = path
        self.cuobjdump = find_tool("cuobjdump")
        self.env = dict(os.environ)
        nvdisasm = find_tool("nvdisasm")
        self.env["PATH"] = f"{nvdisasm.parent}{os.pathsep}{self.env.get('PATH', '')}"
        self._resources: dict[str, dict[str, Resources]] = {}
        self._sass: dict[str, dict[str, str]] = {}

    def _run(self, *args: str) -> str:
        cmd = [str(self.cuobjdump), *args, self.path]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, env=self.env).stdout

    @functools.cached_property
    def elf_archs(self) -> set[str]:
        return set(re.findall(r"ELF file\s+\d+:\s+\S+\.(sm_\w+)\.cubin", self._run("--list-elf")))

    @functools.cached_property
    def ptx_archs(self) -> set[str]:
        return set(re.findall(r"PTX file\s+\d+:\s+\S+\.(sm_\w+)\.ptx", self._run("--list-ptx")))

    def resources(self, arch: str) -> dict[str, Resources]:
        """Mangled kernel name -> resources, for the cubin of one architecture."""
        if arch in self._resources:
            return self._resources[arch]
        out = self._run("-res-usage", "-arch", arch)
        found = {}
        pattern = r"Function (\S+):\s+REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)"
        for name, reg, stack, shared, local in re.findall(pattern, out):
            found[name] = Resources(int(reg), int(stack), int(local), int(shared))
        self._resources[arch] = found
        return found

    def sass(self, arch: str) -> dict[str, str]:
        """Mangled kernel name -> its SASS listing, for one architecture."""
        if arch not in self._sass:
            out = self._run("-sass", "-arch", arch)
            parts = re.split(r"\n\s*Function : (\S+)\n", out)
            self._sass[arch] = dict(zip(parts[1::2], parts[2::2], strict=True))
        return self._sass[arch]
