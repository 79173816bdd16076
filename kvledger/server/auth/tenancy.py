"""Who is calling: the tenant of an API key, its prefix-cache salt, and whether it is an admin.

With API keys every key is a tenant: the Responses API keeps its conversations apart, the
dashboard shows it its own requests, and its prompts are salted in the prefix cache on every
route, so another key's cached blocks never speed up (and so never reveal) its guesses: the
prefix-cache timing side channel of CVE-2025-46570. A request may add
vLLM's ``cache_salt`` on top of its tenant's. ``--share-prefix-cache-across-keys`` drops the
tenant part (hits between keys; the operator trusts every key holder). Without keys there is one
tenant, ``""``, and only ``cache_salt`` separates requests. Admin keys
(``--admin-api-key``) are accepted like any key and see every tenant's requests.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from starlette.requests import Request


def tenant_of(api_key: str | None) -> str:
    """The tenant id of an API key: a hash of the key (``""`` without keys)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else ""


@dataclass(frozen=True)
class Tenancy:
    """The server's tenancy settings.

    Attributes:
        keyed: the server checks API keys (each key a tenant).
        share_prefix_cache: no tenant part in the prefix-cache salt.
        admin_tenants: tenant ids of the admin keys.
    """

    keyed: bool = False
    share_prefix_cache: bool = False
    admin_tenants: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Caller:
    """The tenant of one request and what it may see."""

    tenant: str
    admin: bool
    salted: bool  # the tenant is part of the prefix-cache salt

    def cache_salt(self, request_salt: str | None = None) -> str | None:
        """The prefix-cache salt of a request: the tenant's (when salted) and the request's own
        ``cache_salt``, encoded so that distinct pairs never give one salt; None when neither."""
        tenant = self.tenant if self.salted else None
        if tenant is None and request_salt is None:
            return None
        return json.dumps([tenant, request_salt])


def caller(request: Request) -> Caller:
    """The caller of ``request`` (its key was checked by the API-key middleware)."""
    tenancy: Tenancy = request.app.state.tenancy
    if not tenancy.keyed:
        return Caller("", admin=True, salted=False)
    tenant = tenant_of(request.headers.get("authorization", "").partition(" ")[2])
    return Caller(tenant, admin=tenant in tenancy.admin_tenants,
                  salted=not tenancy.share_prefix_cache)
