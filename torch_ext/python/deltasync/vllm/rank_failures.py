"""Failures of a worker's deltasync call, kept for the engine core instead of raised.

Why: vLLM's multiprocess executor (0.32) stops reading replies at the first rank whose call
raised; the other ranks' replies stay queued, and every later call -- model steps included --
reads a stale one. A refused set-up or a delta refused on every rank would leave a TP >= 2
engine unusable. So a deltasync call on the workers (the backend's init and update, the worker
extension's) returns normally when it fails and keeps the failure on the object that ran it
(the worker, or its weight-transfer backend); the engine core (plugin.py), once every rank has
replied, collects the failures,
closes what the call opened, and raises the first one there -- as the same deltasync error
class, with the same one-line message.
"""
from __future__ import annotations

import importlib
import logging

logger = logging.getLogger("deltasync.vllm")

ATTRIBUTE = "_deltasync_failure"  # (exception class path, message) kept on the worker or backend


def recorded(holder, call, *args, **kwargs):
    """call(*args, **kwargs); on an exception, kept on `holder` for take() and None returned."""
    setattr(holder, ATTRIBUTE, None)
    try:
        return call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - raised again by the engine core
        logger.debug("deltasync call failed on this worker", exc_info=True)
        setattr(holder, ATTRIBUTE, (f"{type(e).__module__}:{type(e).__qualname__}", str(e)))
        return None


def take(*holders) -> tuple[str, str] | None:
    """The failure kept on any of `holders` by their last call (None: it succeeded), cleared."""
    found = None
    for holder in holders:
        failure = getattr(holder, ATTRIBUTE, None)
        if failure is not None:
            setattr(holder, ATTRIBUTE, None)
            found = found or failure
    return found


def raise_first(failures) -> None:
    """Raises the first kept failure of the ranks (in rank order), if any."""
    for failure in failures:
        if failure is not None:
            raise rebuild(failure)


def rebuild(failure: tuple[str, str]) -> Exception:
    """The exception a worker kept, as an instance of its own class when that is one of
    deltasync's or a builtin (a RuntimeError naming the class otherwise)."""
    path, message = failure
    module, _, name = path.partition(":")
    if module == "builtins" or module.startswith("deltasync"):
        try:
            cls = getattr(importlib.import_module(module), name)
            if isinstance(cls, type) and issubclass(cls, Exception):
                return cls(message)
        except (ImportError, AttributeError, TypeError):
            pass
    return RuntimeError(f"{name}: {message}")
