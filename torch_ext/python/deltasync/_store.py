"""Stores for the Python package: every URL (file:///path or a plain path, s3://bucket/prefix,
http(s)://host/path) is opened by the C++ library (host/include/deltasync/store.hpp) and reached
through torch.ops.deltasync.store_*: the folder store's atomic writes and exclusive create, S3's
SigV4, retries, multipart and ranged transfers all live there, configured from the environment
as for the CLI (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL,
DELTASYNC_STORE_*). This module only turns bytes into tensors and C++ errors into Python ones.
"""
from __future__ import annotations

import os
import urllib.parse
from pathlib import Path


class NotFound(KeyError):
    pass


def _ops():
    import torch

    from . import _library

    _library.load()
    return torch.ops.deltasync


class NativeStore:
    """A store of the C++ library, by URL."""

    def __init__(self, url: str):
        self._ops = _ops()
        self.url = url
        try:
            self._ops.store_exists(url, "LATEST")  # opens it now: a malformed URL fails here
        except RuntimeError as e:
            if "unknown store URL" in str(e):
                scheme = urllib.parse.urlparse(url).scheme
                raise ValueError(f"{url}: unknown store URL scheme {scheme!r} ({e})") from None
            raise

    def describe(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def _call(self, op, key: str, *args):
        try:
            return op(self.url, key, *args)
        except RuntimeError as e:
            if "no such object" in str(e):
                raise NotFound(f"{self.describe(key)}: no such object") from None
            if "invalid object key" in str(e):  # bad input, as a Python caller expects it
                raise ValueError(str(e)) from None
            raise

    def put(self, key: str, data: bytes) -> None:
        self._call(self._ops.store_put, key, _as_tensor(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return bool(self._call(self._ops.store_put_if_absent, key, _as_tensor(data)))

    def get(self, key: str) -> bytes:
        return self._call(self._ops.store_get, key).numpy().tobytes()

    def exists(self, key: str) -> bool:
        return bool(self._call(self._ops.store_exists, key))

    def list(self, prefix: str) -> list[str]:
        return list(self._call(self._ops.store_list, prefix))


def FolderStore(root: str | os.PathLike) -> NativeStore:  # noqa: N802  (kept for callers of the old class)
    """The C++ folder store on a local path."""
    return NativeStore("file://" + str(Path(root).absolute()))


def _as_tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def open_store(url) -> NativeStore:
    if isinstance(url, NativeStore):
        return url
    if isinstance(url, os.PathLike):
        return FolderStore(url)
    return NativeStore(url)
