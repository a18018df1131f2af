"""Turns a trigger row (classpath, kwargs text) into a trigger object, or says why not.

The allow-list is checked on the string before anything is imported; kwargs may be
encrypted at rest (Fernet) when a key is configured, as Airflow encrypts them.
"""

from __future__ import annotations

import importlib
from typing import Any

from triggerflow.model import is_allowed
from triggerflow.triggers.base import BaseTrigger
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


class Disallowed(Exception):
    """The class is outside the allowed modules or is not a BaseTrigger: fail the task."""


class Unloadable(Exception):
    """This process cannot import the class (maybe another consumer's newer code can)."""


class BadKwargs(Exception):
    """The stored kwargs do not build the class: fail the task."""


class TriggerLoader:
    def __init__(self, allowed_modules: list[str], codec: KwargsCodec) -> None:
        self.allowed_modules = allowed_modules
        self.codec = codec
        self._classes: dict[str, type[BaseTrigger]] = {}

    def resolve(self, classpath: str) -> type[BaseTrigger]:
        cls = self._classes.get(classpath)
        if cls is not None:
            return cls
        if not is_allowed(classpath, self.allowed_modules):
            raise Disallowed(
                f"trigger class {classpath!r} is not in the allowed modules "
                f"{self.allowed_modules}"
            )
        module_name, _, name = classpath.rpartition(".")
        try:
            module = importlib.import_module(module_name)
            found = getattr(module, name)
        except (ImportError, AttributeError) as exc:
            raise Unloadable(f"cannot import trigger class {classpath!r}: {exc}") from exc
        if not (isinstance(found, type) and issubclass(found, BaseTrigger)):
            raise Disallowed(f"{classpath!r} is not a BaseTrigger subclass")
        self._classes[classpath] = found
        return found

    def build(self, classpath: str, stored_kwargs: str) -> BaseTrigger:
        cls = self.resolve(classpath)
        try:
            return cls(**self.codec.decode(stored_kwargs))
        except MissingKey as exc:
            raise Unloadable(f"cannot decrypt kwargs of {classpath}: {exc}") from exc
        except Exception as exc:
            raise BadKwargs(f"kwargs do not build {classpath}: {exc!r}") from exc
