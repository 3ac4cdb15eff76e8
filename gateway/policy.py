"""Each upstream's policy as plain values, built once from the settings at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

from gateway import decision
from gateway.fingerprint import BodyFields
from gateway.mcp import ToolKind
from gateway.record import KeyCarriers
from gateway.routes import Route
from gateway.settings import KEYLESS_DEFAULTS, ErrorFormat, KeylessMode, Settings, UpstreamSettings

StampKind = Literal["json_field", "form_field", "query_param", "header"]


@dataclass(frozen=True, slots=True)
class HttpProbe:
    method: str
    path: str
    found: str | None
    status: int


@dataclass(frozen=True, slots=True)
class ToolProbe:
    """An MCP server's probe: a read-only tool call at ``path`` ("{key}" in its arguments)."""

    path: str
    tool: str
    arguments: Mapping[str, Any]
    found: str


@dataclass(frozen=True, slots=True)
class PythonProbe:
    entry_point: str
    status: int


@dataclass(frozen=True, slots=True)
class Secrets:
    """Header values injected upstream; kept out of every repr so they never reach a log."""

    headers: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Secrets({sorted(self.headers)!r})"


@dataclass(frozen=True, slots=True)
class UpstreamPolicy:
    name: str
    base_url: str
    timeout: timedelta
    lease: timedelta
    native_header: str | None
    native_ttl: timedelta | None
    stamp: tuple[StampKind, str] | None
    probe: HttpProbe | PythonProbe | ToolProbe | None
    repeat_harmless: bool
    inject: Secrets
    secret_headers: frozenset[str]
    fingerprint_headers: tuple[str, ...]
    # What an unsafe request without a key gets, by method; methods not listed are audited.
    keyless: dict[str, KeylessMode]
    max_connections: int
    connect_timeout: timedelta
    error_format: ErrorFormat
    refuse_random_keys: bool
    # The web origins whose pages may call this upstream from a browser (none by default).
    browser_origins: frozenset[str]
    # The body fields the fingerprint covers; None: the whole body.
    fingerprint_body: BodyFields | None

    # Derived once at start-up (see upstream_policy), not on every request.
    decision: decision.Policy
    # Request headers that must never reach the database: the secret ones and the injected ones.
    never_stored: frozenset[str]
    # The dotted path of a JSON stamp, split once; () for any other stamp.
    json_stamp_path: tuple[str, ...] = ()
    # An MCP server (gateway.mcp) or an HTTP API; for an MCP server, the tools the operator named.
    protocol: Literal["http", "mcp"] = "http"
    tools: Mapping[str, ToolKind] = field(default_factory=dict)


def upstream_policy(name: str, cfg: UpstreamSettings, lease_grace: timedelta) -> UpstreamPolicy:
    stamp: tuple[StampKind, str] | None = None
    if cfg.stamp is not None:
        for kind in ("json_field", "form_field", "query_param", "header"):
            value = getattr(cfg.stamp, kind)
            if value:
                stamp = (kind, value)
    probe: HttpProbe | PythonProbe | ToolProbe | None = None
    if cfg.probe is not None:
        if cfg.probe.tool is not None:
            # Both checked by the settings.
            assert cfg.probe.path is not None
            assert cfg.probe.found is not None
            probe = ToolProbe(cfg.probe.path, cfg.probe.tool, dict(cfg.probe.arguments), cfg.probe.found)
        elif cfg.probe.entry_point:
            probe = PythonProbe(cfg.probe.entry_point, cfg.probe.status)
        else:
            assert cfg.probe.path is not None  # checked by the settings
            probe = HttpProbe(cfg.probe.method, cfg.probe.path, cfg.probe.found, cfg.probe.status)
    # The upstream finishes or abandons a request within its timeout; the grace covers our own write.
    lease = cfg.timeout + lease_grace
    secret = frozenset(h.lower() for h in cfg.secret_headers)
    return UpstreamPolicy(
        name=name,
        base_url=cfg.base_url.rstrip("/"),
        timeout=cfg.timeout,
        lease=lease,
        native_header=cfg.native_key.header if cfg.native_key else None,
        native_ttl=cfg.native_key.ttl if cfg.native_key else None,
        stamp=stamp,
        probe=probe,
        repeat_harmless=cfg.repeat_harmless,
        inject=Secrets({k: v.get_secret_value() for k, v in cfg.inject_headers.items()}),
        secret_headers=secret,
        fingerprint_headers=tuple(cfg.fingerprint_headers),
        keyless={**KEYLESS_DEFAULTS, **cfg.keyless},
        max_connections=cfg.max_connections,
        connect_timeout=cfg.connect_timeout,
        error_format=cfg.error_format,
        refuse_random_keys=cfg.refuse_random_keys,
        browser_origins=frozenset(cfg.browser_origins),
        fingerprint_body=_fingerprint_body(cfg),
        decision=decision.Policy(
            lease=lease,
            native_key_ttl=cfg.native_key.ttl if cfg.native_key else None,
            has_probe=probe is not None,
            probe_routes=tuple(Route.parse(r) for r in cfg.probe.routes or ()) if cfg.probe else (),
            probe_tools=tuple(cfg.probe.tools or ()) if cfg.probe else (),
            key_carriers=KeyCarriers(cfg.native_key.header if cfg.native_key else None, stamp),
            probe_horizon=_probe_horizon(cfg),
            probe_lag=cfg.probe.lag if cfg.probe else timedelta(0),
            repeat_harmless=cfg.repeat_harmless,
            send_window=lease_grace,
        ),
        never_stored=secret | {name.lower() for name in cfg.inject_headers},
        json_stamp_path=tuple(stamp[1].split(".")) if stamp and stamp[0] == "json_field" else (),
        protocol=cfg.protocol,
        tools=dict(cfg.tools),
    )


def _probe_horizon(cfg: UpstreamSettings) -> timedelta | None:
    """How far back the probe's "not found" counts: ``probe.horizon``, else, for a probe that looks for the
    native key alone (no stamp), the key's TTL: an upstream that forgets the key then may no longer find
    the effect by it, and a "not found" after that would send the effect again."""
    if cfg.probe is None:
        return None
    if cfg.probe.horizon is None and cfg.stamp is None and cfg.native_key is not None:
        return cfg.native_key.ttl
    return cfg.probe.horizon


def _fingerprint_body(cfg: UpstreamSettings) -> BodyFields | None:
    if cfg.protocol == "mcp":
        # A tool call is the same call whatever its JSON-RPC id, session or progress token.
        return BodyFields.covering(["params.name", "params.arguments"])
    if cfg.fingerprint_fields is not None:
        return BodyFields.covering(cfg.fingerprint_fields)
    if cfg.fingerprint_ignore is not None:
        return BodyFields.ignoring(cfg.fingerprint_ignore)
    return None


def keyless_mode(policy: UpstreamPolicy, method: str) -> KeylessMode:
    """What a request of ``method`` without an Idempotency-Key gets from this upstream."""
    return policy.keyless.get(method, "audit")


def longest_lease(policies: Mapping[str, UpstreamPolicy]) -> float:
    """Seconds the longest call under way may still take to finish and be recorded."""
    return max((p.lease.total_seconds() for p in policies.values()), default=0.0)


def upstream_policies(settings: Settings) -> dict[str, UpstreamPolicy]:
    return {
        name: upstream_policy(name, cfg, settings.lease_grace) for name, cfg in settings.upstreams.items()
    }
