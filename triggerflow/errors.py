"""The root of the errors triggerflow raises on purpose.

``except TriggerflowError`` catches every one of them: the store's (``StoreError`` and its
kinds), the transport's (``TransportError`` and its kinds), configuration that cannot work
(``ConfigurationError``: a missing kwargs key, an unknown Airflow schema, a bad flag) and the
rest (wire, loader, lease, SDK). Each keeps the built-in base it had (``ValueError``,
``ConnectionError`` ...), so older ``except`` clauses still match. Imports nothing.
"""

from __future__ import annotations


class TriggerflowError(Exception):
    """Base of every error triggerflow raises on purpose."""


class ConfigurationError(TriggerflowError):
    """A setting, flag or deployment fact that cannot work as given: fix it, do not retry."""


class SettingRefused(ConfigurationError, ValueError):
    """A setting the deployment refuses as given, found once a process reached it (an Airflow
    team Airflow does not have): the command ends as for a bad flag, one line and exit 2."""
