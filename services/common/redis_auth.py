"""A Redis password for a stack, written as the two files that use it, never as argv:

    redis.conf   `requirepass <password>`, for `redis-server /path/redis.conf ...`
    redis-url    the master's URL with the password in it, for `--redis-url @/path/redis-url`

Both 0640 (the Redis container reads them through its supplementary group). An existing pair
is kept (a restarted stack keeps its password); `make_redis_auth` returns the folder's URL.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

CONF_FILE = "redis.conf"
URL_FILE = "redis-url"


def url_with_password(url: str, password: str) -> str:
    """`url` (redis://host:port/db, no credentials) with `password` for the default user."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"redis url must be redis://HOST:PORT/DB, got {url!r}")
    if parts.username or parts.password:
        raise ValueError("the redis url must not carry credentials: they are made here")
    return urlunsplit(parts._replace(netloc=f":{password}@{parts.netloc}"))


def make_redis_auth(out_dir: str | os.PathLike, url: str) -> str:
    out = Path(out_dir)
    conf, url_file = out / CONF_FILE, out / URL_FILE
    if conf.exists() and url_file.exists():
        return url_file.read_text().strip()
    out.mkdir(parents=True, exist_ok=True, mode=0o750)
    password = secrets.token_urlsafe(32)  # URL-safe: no escaping in the URL or the config
    full = url_with_password(url, password)
    for path, text in ((conf, f"requirepass {password}\n"), (url_file, full)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return full
