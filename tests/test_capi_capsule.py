"""dpmini._dpmini lends dpmini._dist its NCCL launch lock and its library
search through one C API capsule (csrc/core/capi.h), so that the process has
one of each whichever extension calls."""
import ctypes
import re
from pathlib import Path

import dpmini

CAPI_H = Path(__file__).resolve().parents[1] / "csrc" / "core" / "capi.h"


def test_dpmini_exports_its_c_api_as_a_named_capsule():
    cap = dpmini._dpmini._C_API
    assert type(cap).__name__ == "PyCapsule"
    is_valid = ctypes.pythonapi.PyCapsule_IsValid
    is_valid.restype = ctypes.c_int
    is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    assert is_valid(cap, b"dpmini._dpmini._C_API") == 1
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    version = ctypes.c_uint.from_address(get(cap, b"dpmini._dpmini._C_API")).value
    want = int(re.search(r"#define DP_CAPI_VERSION (\d+)", CAPI_H.read_text()).group(1))
    assert version == want
