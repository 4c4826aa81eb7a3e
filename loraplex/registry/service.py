"""The registry's use cases in one namespace.

Every function takes a SQLAlchemy ``Session`` and never commits: the request handler or CLI
command that opened the session owns the transaction (``db.transaction``). They flush, so
ids exist and constraint violations surface as domain errors (ConflictError,
NotFoundError, AdapterNotFoundError, InvalidRequestError) at the call that caused them.
"""

from __future__ import annotations

from loraplex.registry.adapters import (
    delete_adapter,
    get_adapter,
    is_digest_referenced,
    list_adapters,
    list_visible_adapters,
    record_effect,
    register_adapter,
    resolve_adapter,
    set_visibility,
    shadowed_names,
)
from loraplex.registry.api_keys import (
    ADMIN_TENANT,
    DEFAULT_TENANT,
    KEY_PREFIX,
    Principal,
    admin_tenant,
    authenticate,
    create_admin_key,
    create_key,
    default_tenant,
    generate_key,
    hash_key,
    list_keys,
    revoke_key,
)
from loraplex.registry.tenants import (
    QUOTA_CHECKS,
    SCHEDULING_CHECKS,
    UNSET,
    create_tenant,
    get_tenant,
    get_tenant_by_name,
    list_tenants,
    set_tenant_status,
    update_tenant_limits,
)
from loraplex.registry.usage import (
    UsageRecord,
    UsageTotals,
    hour_start,
    list_usage,
    record_usage,
    usage_totals,
)
from loraplex.registry.versions import (
    NameVersions,
    Resolution,
    Traffic,
    cancel_split,
    check_percent,
    check_version,
    name_versions,
    promote,
    resolve_versions,
    start_split,
    traffic,
)

__all__ = [
    "ADMIN_TENANT", "DEFAULT_TENANT", "KEY_PREFIX", "QUOTA_CHECKS", "SCHEDULING_CHECKS", "UNSET", "NameVersions",
    "Principal", "Resolution", "Traffic", "UsageRecord", "UsageTotals",
    "cancel_split", "check_percent", "check_version", "name_versions", "promote",
    "resolve_versions", "start_split", "traffic",
    "admin_tenant", "authenticate", "create_admin_key", "create_key", "create_tenant", "default_tenant", "delete_adapter", "generate_key",
    "get_adapter", "get_tenant", "get_tenant_by_name", "hash_key", "hour_start",
    "is_digest_referenced", "list_adapters", "list_keys", "list_tenants", "list_usage",
    "list_visible_adapters", "record_effect", "record_usage", "register_adapter",
    "resolve_adapter",
    "revoke_key", "set_tenant_status", "set_visibility", "shadowed_names",
    "update_tenant_limits",
    "usage_totals",
]
