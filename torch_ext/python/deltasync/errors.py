"""What can go wrong, as exception classes a caller can act on (the C++ library raises them by
the kind of its error; messages stay one line naming the file or tensor and the reason).

    DeltaSyncError                    base of everything below
      BadDeltaError(ValueError)       a delta, anchor, manifest or file that is corrupt or does
                                      not fit the model (nothing was written)
      InvalidArgumentError(ValueError) an argument that cannot work
      IntegrityError                  weights that do not hash to what was promised
        WrongBaseError                a delta made for other weights than the receiver holds
      StoreError                      the store
        NotFoundError(KeyError)       no such object / version
        StoreUnavailableError         no answer after every retry (transport, 5xx)
        CredentialsError              credentials refused (401/403) or missing
        UnsupportedError              the store cannot do this (e.g. list over plain HTTP)
"""
from __future__ import annotations


class DeltaSyncError(RuntimeError):
    """Base class of deltasync's errors."""


class BadDeltaError(DeltaSyncError, ValueError):
    """A delta, anchor, manifest or file is corrupt or does not fit the model."""


class InvalidArgumentError(DeltaSyncError, ValueError):
    """An argument that cannot work (a version not newer than the last, an unknown store URL)."""


class IntegrityError(DeltaSyncError):
    """Weights do not hash to what a delta or manifest promised."""


class WrongBaseError(IntegrityError):
    """A delta was made for other weights than the receiver holds."""


class StoreError(DeltaSyncError):
    """The store failed."""


class NotFoundError(StoreError, KeyError):
    """The store has no such object or version."""

    def __str__(self) -> str:  # KeyError would quote the message
        return RuntimeError.__str__(self)


class StoreUnavailableError(StoreError):
    """The store did not answer after every retry."""


class CredentialsError(StoreError):
    """The store refused the credentials, or none were given."""


class UnsupportedError(StoreError):
    """The store cannot do what was asked."""


__all__ = ["DeltaSyncError", "BadDeltaError", "InvalidArgumentError", "IntegrityError", "WrongBaseError", "StoreError", "NotFoundError",
           "StoreUnavailableError", "CredentialsError", "UnsupportedError"]
