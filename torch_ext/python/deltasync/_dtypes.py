"""torch dtypes and their safetensors names (the spelling the C++ library and files use)."""
from __future__ import annotations

import torch

ST_DTYPE = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPE = {v: k for k, v in ST_DTYPE.items()}
