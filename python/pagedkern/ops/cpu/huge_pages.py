"""CPU tensors on transparent huge pages where Linux offers them (THP "madvise" or "always").

The KV cache is read in short runs: a page of one head is block_size x D elements (4 KiB at 16
x 128 bf16), each run a different 4 KiB page, so attention at depth pays a TLB miss a run and
the hardware prefetchers stop at every page's edge; 2 MiB pages spare the misses
(docs/guides/cpu-backend.md, "The KV cache"). The advice is a hint: where the kernel declines
(THP off, no free huge pages, another OS), the tensor is the same, on 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    """libc's madvise, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def huge_page_span(address: int, nbytes: int) -> tuple[int, int] | None:
    """(start, length) of the whole huge pages inside [address, address + nbytes), or None."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (start, end - start) if end > start else None


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, its whole 2 MiB spans advised onto huge pages
    before the zeros first touch them (an allocation this large is a fresh mapping)."""
    tensor = torch.empty(shape, dtype=dtype)
    span = huge_page_span(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    madvise = _madvise()
    if span is not None and madvise is not None:
        madvise(span[0], span[1], _MADV_HUGEPAGE)  # (a refusal leaves 4 KiB pages)
    return tensor.zero_()
