"""The folder store in Python, with the same semantics as deltasync's C++ folder store
(host/include/deltasync/store.hpp): objects written whole via a temporary name and rename,
exclusive create for manifests. Other URL schemes (s3://, http://) are served by the C++
library and the `deltasync` CLI; this package does not bind them yet.
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


def open_store(url: str | os.PathLike | FolderStore) -> FolderStore:
    if isinstance(url, FolderStore):
        return url
    text = os.fspath(url)
    parsed = urllib.parse.urlparse(text)
    if parsed.scheme == "file":
        return FolderStore(urllib.parse.unquote(parsed.path))
    if parsed.scheme == "":
        return FolderStore(text)
    raise ValueError(
        f"{text}: the Python package supports folder stores (file:///path) only; use the deltasync "
        f"CLI (deltasync publish / pull) for {parsed.scheme}:// stores"
    )
