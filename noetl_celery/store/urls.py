"""A store URL as it may be shown: its password hidden, whatever the URL's shape."""

from __future__ import annotations

import re

from noetl_celery.config import secret_registry


def safe_url(url: str) -> str:
    """`url` with its password replaced by ***, also when the URL does not parse (the whole
    user-info part when a password holds an unencoded '@')."""
    from noetl_celery.config.settings import mask_url, unencoded_at

    if unencoded_at(url):
        return mask_url(url)
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return secret_registry.mask_text(re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url))
