"""Small synthetic models for the store tests: bf16 weights kept as uint16 bit patterns (numpy has
no bfloat16), written and read as safetensors without torch, and trainer-like steps that move about
1% of the elements by one unit in the last place."""
import json
import struct
from pathlib import Path

import numpy as np

SHAPES = {"model.layers.0.mlp.weight": (64, 96), "model.layers.1.attn.weight": (96, 64), "model.embed": (128, 32)}


class SyntheticModel:
    def __init__(self, seed=0, shapes=SHAPES):
        self.rng = np.random.default_rng(seed)
        # Realistic bit patterns: small normal floats rounded to bf16 (the top 16 bits of f32).
        self.tensors = {}
        for name, shape in shapes.items():
            f32 = (self.rng.standard_normal(shape) * 0.02).astype(np.float32)
            self.tensors[name] = (f32.view(np.uint32) >> 16).astype(np.uint16)

    def step(self, density=0.01):
        for arr in self.tensors.values():
            mask = self.rng.random(arr.shape) < density
            delta = np.where(self.rng.random(arr.shape) < 0.5, 1, -1).astype(np.int32)
            arr[mask] = (arr[mask].astype(np.int32) + delta[mask]).astype(np.uint16)

    def snapshot(self):
        return {name: arr.copy() for name, arr in self.tensors.items()}

    def save(self, path, version=None):
        write_safetensors(path, self.tensors, version)


def write_safetensors(path, tensors, version=None):
    header, offset, blobs = {}, 0, []
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if version is not None:
        header["__metadata__"] = {"model_version": str(version)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    """Returns ({name: uint16 array} for BF16 tensors, metadata)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, info in header.items():
        assert info["dtype"] == "BF16", info
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(raw[base + b:base + e], dtype=np.uint16).reshape(info["shape"])
    return out, meta


def assert_identical(path, expected, version=None):
    got, meta = read_safetensors(path)
    assert sorted(got) == sorted(expected), f"{path}: tensors {sorted(got)} != {sorted(expected)}"
    for name, arr in expected.items():
        assert np.array_equal(got[name], arr), f"{path}: tensor {name} differs"
    if version is not None:
        assert meta.get("model_version") == str(version), f"{path}: model_version {meta.get('model_version')} != {version}"
