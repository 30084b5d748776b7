"""Which configuration values are credentials: decided by their type, never by a key's name.

soakd reads the API key from an environment variable or a file at run time
(``SoakConfig.api_key``); the configuration holds only where to read it from. What else a
configuration can carry that is a credential, and how each is typed:

* the simulator's own key (``sim.api_key``): ``SecretStr``;
* an extra HTTP header that can carry a credential (``target.headers``): its value becomes a
  ``SecretStr`` when it is validated (``credential_header`` decides by the header's name, the one
  place where a name decides, since HTTP gives credentials no other mark);
* the user and password of a URL (``target.url``, ``samplers.dcgm.url``, ``samplers.server.url``):
  the URL fields are ``Url``, which shows them as ``***`` when serialised for display.

``SoakConfig.redacted()`` (JSON-mode serialisation) is what ``--print-config`` prints, what the
store keeps and the report shows, and what the ``soakd_started`` log line carries: ``SecretStr``
values come out as ``MASK``, URLs with ``mask_url``; every other value as it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import PlainSerializer, PlainValidator, SecretStr, WithJsonSchema

__all__ = ["MASK", "URL_MASK", "HeaderValue", "Url", "credential_header", "mask_url", "plain"]

MASK = "**********"  # what pydantic shows for a SecretStr
URL_MASK = "***"  # a URL's user and password, and a credential in its query

# header (and URL query parameter) names that carry credentials: the standard ones, and any name with
# one of these words in it (X-Api-Key, api-key, X-Auth-Token, X-Amz-Security-Token, X-Session-Id, ...)
_CREDENTIAL_NAME = re.compile(r"auth|cookie|token|key|secret|passw|credential|session|signature", re.I)


def credential_header(name: str) -> bool:
    """Whether a header (or URL query parameter) of this name can carry a credential:
    Authorization, Proxy-Authorization, Cookie, X-Api-Key, api-key, and any name containing auth,
    cookie, token, key, secret, passw(ord), credential, session or signature (any case)."""
    return _CREDENTIAL_NAME.search(name) is not None


def mask_url(url: Any) -> Any:
    """The URL with its user and password, and the values of credential query parameters
    (``credential_header``), shown as ``***``; anything else (not a URL, no credential) unchanged."""
    if not isinstance(url, str) or "://" not in url:
        return url
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return url
    netloc = parts.netloc
    if parts.username is not None or parts.password is not None:
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 literal
            host = f"[{host}]"
        netloc = f"{URL_MASK}@{host}" + (f":{port}" if port is not None else "")
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(credential_header(k) for k, _ in pairs):
            query = urlencode([(k, URL_MASK if credential_header(k) else v) for k, v in pairs], safe="*")
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# a URL field: a plain str to the code that connects, masked when serialised for display (JSON mode)
Url = Annotated[str, PlainSerializer(mask_url, return_type=str, when_used="json")]


def _header_value(v: Any) -> str | SecretStr:
    if isinstance(v, str | SecretStr):
        return v
    raise ValueError("expected a string (quote a number in YAML)")


# an extra header's value: a str, or a SecretStr for a credential (``TargetConfig`` decides by the name)
HeaderValue = Annotated[str | SecretStr, PlainValidator(_header_value), WithJsonSchema({"type": "string"})]


def plain(values: Mapping[str, str | SecretStr]) -> dict[str, str]:
    """The values as sent: ``SecretStr`` unwrapped."""
    return {k: v.get_secret_value() if isinstance(v, SecretStr) else v for k, v in values.items()}
