"""Trigger kwargs at rest in native mode: JSON text, or Fernet-encrypted as Airflow does.

Pure: imports no I/O (``cryptography`` only when a key is set). The SDK encodes with it, the
PostgreSQL store decodes claimed rows with it.
"""

from __future__ import annotations

from typing import Any

from triggerflow.wire import decode_json, encode_json

ENCRYPTED_PREFIX = "fernet:"


class MissingKey(ValueError):
    """Encrypted kwargs and no key here: another consumer of the queue may have it."""


class KwargsCodec:
    """JSON text, or ``fernet:<token>`` when a key is set. Reads both, so a key can be added."""

    def __init__(self, key: str | None = None) -> None:
        self._fernet: Any = None
        if key:
            from cryptography.fernet import Fernet

            self._fernet = Fernet(key.encode())

    def encode(self, kwargs: dict[str, Any]) -> str:
        text = encode_json(kwargs)
        if self._fernet is None:
            return text
        token: bytes = self._fernet.encrypt(text.encode())
        return ENCRYPTED_PREFIX + token.decode()

    def decode(self, stored: str) -> dict[str, Any]:
        if stored.startswith(ENCRYPTED_PREFIX):
            if self._fernet is None:
                raise MissingKey("kwargs are encrypted but this process has no kwargs_key")
            plain: bytes = self._fernet.decrypt(stored[len(ENCRYPTED_PREFIX):].encode())
            stored = plain.decode()
        value = decode_json(stored)
        if not isinstance(value, dict):
            raise ValueError(f"kwargs must be a JSON object, got {type(value).__name__}")
        return value
