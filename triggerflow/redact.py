"""Removing secrets from text the operator commands print (URLs may carry passwords)."""

from __future__ import annotations

import re

from yarl import URL

from triggerflow.settings import Settings

_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@\s]*@", re.I)


class Redactor:
    """Removes the passwords of the configured URLs (and of any URL) from text."""

    def __init__(self, settings: Settings) -> None:
        self.secrets: list[str] = []
        for url in (settings.amqp_url.get_secret_value(), settings.database_url.get_secret_value(),
                    settings.management_dsn()):
            password = URL(url).raw_password
            if password:
                self.secrets += {password, URL(url).password or password}
        for keys in (settings.kwargs_key, *settings.kwargs_keys.values()):
            if keys is not None:
                self.secrets.append(keys.get_secret_value())
                self.secrets += [k.strip() for k in keys.get_secret_value().split(",")]

    def __call__(self, text: str) -> str:
        text = _USERINFO.sub(r"\g<scheme>\g<user>:***@", text)
        for secret in self.secrets:
            if len(secret) >= 3:  # a one-letter password would mangle every line
                text = text.replace(secret, "***")
        return text

