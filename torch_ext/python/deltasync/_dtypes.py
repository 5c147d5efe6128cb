"""torch dtypes and their safetensors names (the spelling the C++ library and files use), from the
C++ dtype table (core/dtype.hpp, paired with torch's in torch_ext/src/torch_dtype.cpp)."""
from __future__ import annotations

from ._library import native

_ROWS = native().dtype_table()  # (name, width, weight, torch dtype)

ST_DTYPE = {dtype: name for name, _, _, dtype in _ROWS}
TORCH_DTYPE = {name: dtype for name, _, _, dtype in _ROWS}
WEIGHT_DTYPES = frozenset(dtype for _, _, weight, dtype in _ROWS if weight)
