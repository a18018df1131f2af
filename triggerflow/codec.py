"""Trigger kwargs at rest in native mode: JSON text, or Fernet-encrypted as Airflow does.

Keys are per queue where ``kwargs_keys`` names the queue (so one team's key opens only its
own triggers), else ``kwargs_key``. Each is one key or several, comma-separated, newest
first: the newest encrypts, all decrypt (``MultiFernet``), which is how a key is rotated.

Pure: imports no I/O (``cryptography`` only when a key is set). The SDK encodes with it, the
PostgreSQL store decodes claimed rows with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from triggerflow.errors import ConfigurationError
from triggerflow.wire import decode_json, encode_json

ENCRYPTED_PREFIX = "fernet:"


class SecretLike(Protocol):
    def get_secret_value(self) -> str: ...


class MissingKey(ConfigurationError, ValueError):
    """Encrypted kwargs and no key here: another consumer of the queue may have it."""


def _multi_fernet(keys: str) -> Any:
    from cryptography.fernet import Fernet, MultiFernet

    parts = [k.strip() for k in keys.split(",") if k.strip()]
    return MultiFernet([Fernet(k.encode()) for k in parts])


class KwargsCodec:
    """JSON text, or ``fernet:<token>`` when the queue has a key. Reads both, so a key can
    be added; reads tokens of every key listed, so a key can be rotated."""

    def __init__(self, key: str | None = None, queue_keys: Mapping[str, str] | None = None) -> None:
        self._default: Any = _multi_fernet(key) if key else None
        self._by_queue: dict[str, Any] = {
            queue: _multi_fernet(keys) for queue, keys in (queue_keys or {}).items() if keys}

    @classmethod
    def from_secrets(cls, key: SecretLike | None, queue_keys: Mapping[str, SecretLike]) -> KwargsCodec:
        """From settings' ``kwargs_key`` and ``kwargs_keys`` (pydantic ``SecretStr``)."""
        return cls(key.get_secret_value() if key else None,
                   {q: k.get_secret_value() for q, k in queue_keys.items()})

    def _fernet(self, queue: str | None) -> Any:
        if queue is not None and queue in self._by_queue:
            return self._by_queue[queue]
        return self._default

    def encode(self, kwargs: dict[str, Any], queue: str | None = None) -> str:
        text = encode_json(kwargs)
        fernet = self._fernet(queue)
        if fernet is None:
            return text
        token: bytes = fernet.encrypt(text.encode())
        return ENCRYPTED_PREFIX + token.decode()

    def decode(self, stored: str, queue: str | None = None) -> dict[str, Any]:
        if stored.startswith(ENCRYPTED_PREFIX):
            fernet = self._fernet(queue)
            if fernet is None:
                raise MissingKey("kwargs are encrypted but this process has no key for "
                                 f"queue {queue!r} (kwargs_keys / kwargs_key)")
            plain: bytes = fernet.decrypt(stored[len(ENCRYPTED_PREFIX):].encode())
            stored = plain.decode()
        value = decode_json(stored)
        if not isinstance(value, dict):
            raise ValueError(f"kwargs must be a JSON object, got {type(value).__name__}")
        return value
