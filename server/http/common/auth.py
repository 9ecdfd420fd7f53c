"""Bearer keys: `api_key` guards every /v1 endpoint, `admin_api_key` the model mutations.

Safe default: a server that listens beyond loopback without an `admin_api_key` refuses model
mutations (403), since anyone who reaches the port could otherwise swap its models.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
from typing import Annotated

from fastapi import Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from server.http.common.errors import APIError

log = logging.getLogger(__name__)

# Declares the scheme in the OpenAPI document; the checks below read the header themselves.
bearer_scheme = HTTPBearer(auto_error=False, description="`Authorization: Bearer KEY`")
MUTATIONS_DISABLED = (
    "model changes are disabled: this server listens on {host} without an admin key; set "
    "server.admin_api_key (config.yaml, or the MLX_SPEC_SERVER__ADMIN_API_KEY environment "
    "variable) and send it as `Authorization: Bearer KEY` to enable them"
)
# Anthropic's clients send the key as `x-api-key`: accepted as well as the bearer header.
api_key_scheme = APIKeyHeader(name="x-api-key", auto_error=False,
                              description="`x-api-key: KEY` (Anthropic's header)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)]
HeaderKey = Annotated[str | None, Security(api_key_scheme)]
_TENANT_SECRET = secrets.token_bytes(16)  # `tenant_of`'s key


def _client_key(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip() or None


def tenant_of(request: Request) -> str:
    """An opaque id of the API key that sent `request`, for what the engine keeps per key
    (suffix drafting's served texts: one key's text never drafts another key's answer); ""
    when the server takes no key (every client is one tenant). A keyed hash with a secret of
    this process, so neither logs nor memory hold the key itself."""
    if not request.app.state.settings.server.api_key:
        return ""
    given = (_client_key(request) or "").encode()
    return hmac.new(_TENANT_SECRET, given, hashlib.sha256).hexdigest()[:16]


def _matches(given: str | None, expected: str) -> bool:
    return given is not None and secrets.compare_digest(given.encode(), expected.encode())


def mutations_locked(server) -> bool:
    return not server.admin_api_key and not is_loopback(server.host)


def log_exposure(server) -> None:
    """The start-up line that says whether model mutations are open, and to whom."""
    if mutations_locked(server):
        log.warning(MUTATIONS_DISABLED.format(host=server.host))
    elif not server.admin_api_key:
        log.info("model changes are open to local clients (%s, no admin_api_key)", server.host)


def require_api_key(
    request: Request, _: Credentials = None, __: HeaderKey = None
) -> None:
    server = request.app.state.settings.server
    given = _client_key(request)  # or x-api-key
    keys = [k for k in (server.api_key, server.admin_api_key) if k]
    if server.api_key and not any(_matches(given, k) for k in keys):
        raise APIError(401, "missing or invalid API key", code="invalid_api_key")


def require_admin_key(
    request: Request, _: Credentials = None
) -> None:
    server = request.app.state.settings.server
    if mutations_locked(server):
        raise APIError(403, MUTATIONS_DISABLED.format(host=server.host),
                       code="model_changes_disabled")
    expected = server.admin_api_key or server.api_key
    if expected and not _matches(_client_key(request), expected):
        raise APIError(401, "missing or invalid admin API key", code="invalid_api_key")


LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
