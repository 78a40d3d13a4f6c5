"""A stand-in for a CUDA array: it exposes __cuda_array_interface__ (v3) over a fake pointer, so
argument validation can be tested on machines without a GPU. Nothing may ever dereference it."""

from __future__ import annotations

FAKE_POINTER = 0x7F00_0000_0000
TYPESTR = {"float32": "<f4", "float16": "<f2", "int32": "<i4", "int64": "<i8", "uint8": "|u1"}


class FakeCudaArray:
    def __init__(self, shape, dtype="float16", strides=None, offset=0):
        itemsize = int(TYPESTR[dtype][-1])
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": tuple(shape),
            "typestr": TYPESTR[dtype],
            "data": (FAKE_POINTER + offset * itemsize, False),
            "strides": None if strides is None else tuple(s * itemsize for s in strides),
            "stream": None,
        }
