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
from airflow.models.crypto import get_fernet
from airflow.models.trigger import Trigger
from airflow.serialization.decoders import smart_decode_trigger_kwargs

# Airflow's timer triggers: their kwargs (a DateTime, a bool) are immutable once decoded,
# so one decoded dict may serve every row with the same plaintext.
TIMER_CLASSPATHS = frozenset({
    "airflow.providers.standard.triggers.temporal.DateTimeTrigger",
    "airflow.providers.standard.triggers.temporal.TimeDeltaTrigger",
})
_DECODED_LIMIT = 1024
_decoded: dict[str, dict[str, Any]] = {}


def decode_kwargs(encrypted_kwargs: str, classpath: str | None = None) -> dict[str, Any]:
    """The keyword arguments Airflow's triggerer would pass to the trigger class.

    For ``TIMER_CLASSPATHS`` the decoded dict is shared by rows whose decrypted text is equal:
    a burst of N sensors waiting for one instant is one serde decode, not N (decoding was
    most of a claim's cost). Decryption is still per row, and the decode is Airflow's own
    function on the plaintext (``_decrypt_kwargs`` reads unencrypted JSON as it is).
    """
    if classpath not in TIMER_CLASSPATHS or encrypted_kwargs.startswith("{"):
        return _decode(Trigger._decrypt_kwargs(encrypted_kwargs))
    plain = get_fernet().decrypt(encrypted_kwargs.encode("utf-8")).decode("utf-8")
    kwargs = _decoded.get(plain)
    if kwargs is None:
        kwargs = _decode(Trigger._decrypt_kwargs(plain))
        if len(_decoded) >= _DECODED_LIMIT:
            _decoded.clear()
        _decoded[plain] = kwargs
    return kwargs


def _decode(decoded: dict[str, Any]) -> dict[str, Any]:
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
