"""PostgreSQL URLs with several hosts, for a primary and its standbys.

libpq and asyncpg take ``postgresql://user@h1:5432,h2:5432/db?target_session_attrs=read-write``
and try the hosts in turn until one is read-write: after a standby is promoted every new
connection finds it (docs/failure-modes.md, "PostgreSQL restart or failover"). SQLAlchemy's
``make_url`` (migrations, ``with_database``) cannot parse a port list in the authority and
wants the hosts as repeated ``?host=h:port`` parameters instead; these two functions move them
from one form to the other, so a URL is still only ever edited through ``make_url``.
"""

from __future__ import annotations

from urllib.parse import quote

from sqlalchemy.engine import URL, make_url


def parse(dsn: str) -> URL:
    """``make_url`` that also takes the libpq multi-host form (hosts become ``?host=``)."""
    scheme, sep, rest = dsn.partition("://")
    authority, slash, tail = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if not sep or "," not in hosts:
        return make_url(dsn)
    path, question, query = tail.partition("?")
    params = "&".join(f"host={quote(h, safe=':')}" for h in hosts.split(","))
    return make_url(
        f"{scheme}://{userinfo}{at}{slash}{path}?{params}" + (f"&{query}" if question and query else "")
    )


def render(url: URL) -> str:
    """The URL as asyncpg and libpq read it: several ``?host=`` back in the authority."""
    hosts = url.query.get("host")
    if not isinstance(hosts, tuple):
        return url.render_as_string(hide_password=False)
    single = url.difference_update_query(["host"]).set(host="MULTIHOST").render_as_string(hide_password=False)
    return single.replace("MULTIHOST", ",".join(hosts), 1)
