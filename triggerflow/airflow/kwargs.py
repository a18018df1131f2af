"""Rebuild Airflow trigger objects from Airflow's ``trigger`` rows with Airflow's own code.

The encrypted ``kwargs`` column is decrypted with the Fernet key from Airflow's configuration
and decoded with Airflow's serde (``Trigger._decrypt_kwargs``, which falls back to the older
BaseSerialization form), then cleaned with ``smart_decode_trigger_kwargs`` exactly as
``airflow triggerer`` does before it calls ``cls(**kwargs)``. Nothing here re-implements a
format, so a row Airflow can run is a row triggerflow can run, and one it cannot is not.

Importing this module imports Airflow (``triggerflow[airflow]``).
"""

from __future__ import annotations

from typing import Any

from airflow._shared.module_loading import import_string
from airflow.models.trigger import Trigger
from airflow.serialization.decoders import smart_decode_trigger_kwargs


def decode_kwargs(encrypted_kwargs: str) -> dict[str, Any]:
    """The keyword arguments Airflow's triggerer would pass to the trigger class."""
    decoded = Trigger._decrypt_kwargs(encrypted_kwargs)
    return {key: smart_decode_trigger_kwargs(value)  # type: ignore[no-untyped-call]
            for key, value in decoded.items()}


def load_trigger_class(classpath: str) -> type[Any]:
    """Import the class named by an Airflow ``trigger.classpath`` (allow-list checked first)."""
    cls = import_string(classpath)
    if not isinstance(cls, type):
        raise TypeError(f"{classpath} is not a class")
    return cls


def build_trigger(classpath: str, encrypted_kwargs: str) -> Any:
    """An instance of Airflow's trigger class, as ``airflow triggerer`` would build it."""
    return load_trigger_class(classpath)(**decode_kwargs(encrypted_kwargs))


def encrypt_kwargs(kwargs: dict[str, Any]) -> str:
    """Encrypt kwargs as Airflow writes them into ``trigger.kwargs`` (tests, bench)."""
    return Trigger.encrypt_kwargs(kwargs)
