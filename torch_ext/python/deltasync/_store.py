"""Stores for the Python package.

- file:///path (or a plain path): FolderStore, in Python, with the same semantics as deltasync's
  C++ folder store (objects written whole via a temporary name and rename, exclusive create for
  manifests).
- s3://bucket/prefix, http(s)://host/path: NativeStore, the C++ library's stores (SigV4,
  retries, multipart and ranged transfers; options and credentials from the environment as for
  the CLI: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL, ...) through
  torch.ops.deltasync.store_*.
"""
from __future__ import annotations

import os
import secrets
import urllib.parse
from pathlib import Path


class NotFound(KeyError):
    pass


class FolderStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return "file://" + str(self.root)

    def describe(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"{self.url}: invalid object key {key!r}")
        return self.root / key

    def _write_temp(self, path: Path, data: bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.tmp.{secrets.token_hex(6)}")
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return temp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        temp = self._write_temp(path, data)
        os.replace(temp, path)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Creates the object only if absent (a hard link fails when the name exists, so exactly
        one of two racing writers wins and a reader never sees a partial object)."""
        path = self._path(key)
        temp = self._write_temp(path, data)
        try:
            os.link(temp, path)
            return True
        except FileExistsError:
            return False
        finally:
            temp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{self.describe(key)}: no such object") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self.root
        keys = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.startswith("."):
                    continue  # temporary files of writers in progress
                key = os.path.relpath(os.path.join(dirpath, name), base).replace(os.sep, "/")
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)


class NativeStore:
    """A store of the C++ library, by URL."""

    def __init__(self, url: str):
        import torch

        from . import _library

        _library.load()
        self._ops = torch.ops.deltasync
        self.url = url
        self._ops.store_exists(url, "LATEST")  # opens it now: a malformed URL fails here

    def describe(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self._ops.store_put(self.url, key, _as_tensor(data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return bool(self._ops.store_put_if_absent(self.url, key, _as_tensor(data)))

    def get(self, key: str) -> bytes:
        try:
            return self._ops.store_get(self.url, key).numpy().tobytes()
        except RuntimeError as e:
            if "no such object" in str(e):
                raise NotFound(f"{self.describe(key)}: no such object") from None
            raise

    def exists(self, key: str) -> bool:
        return bool(self._ops.store_exists(self.url, key))

    def list(self, prefix: str) -> list[str]:
        return sorted(self._ops.store_list(self.url, prefix))


def _as_tensor(data: bytes):
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def open_store(url):
    if isinstance(url, (FolderStore, NativeStore)):
        return url
    text = os.fspath(url)
    parsed = urllib.parse.urlparse(text)
    if parsed.scheme == "file":
        return FolderStore(urllib.parse.unquote(parsed.path))
    if parsed.scheme == "":
        return FolderStore(text)
    if parsed.scheme in ("s3", "http", "https"):
        return NativeStore(text)
    raise ValueError(f"{text}: unknown store URL scheme {parsed.scheme!r} (file://, s3://, http(s)://)")
