"""The one error of the data pipeline: a corpus or prepared folder a user must fix."""

from __future__ import annotations


class DataError(ValueError):
    """The input or the prepared data cannot be used; the message says which and what to do."""
