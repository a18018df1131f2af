"""Removing secrets from text the operator commands print (URLs may carry passwords)."""

from __future__ import annotations

import re

from yarl import URL

from triggerflow.settings import Settings

_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):[^@\s]*@", re.I)


def _url(url: str) -> URL | None:
    """``url`` parsed; a host list (``h1:5432,h2:5432``, a primary and its standbys) is not a
    URL yarl reads, so its first host stands for all (the password is the same)."""
    try:
        return URL(url)
    except ValueError:
        head, sep, rest = url.partition("://")
        authority, slash, tail = rest.partition("/")
        try:
            return URL(f"{head}{sep}{authority.split(',')[0]}{slash}{tail}")
        except ValueError:
            return None  # the regex above still hides its password


class Redactor:
    """Removes the passwords of the configured URLs (and of any URL) from text."""

    def __init__(self, settings: Settings) -> None:
        self.secrets: list[str] = []
        for url in (settings.amqp_url.get_secret_value(), settings.database_url.get_secret_value(),
                    settings.management_dsn()):
            parsed = _url(url)
            password = parsed.raw_password if parsed is not None else None
            if password and parsed is not None:
                self.secrets += {password, parsed.password or password}
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

