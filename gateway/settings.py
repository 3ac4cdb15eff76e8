"""The gateway's configuration: one TOML file plus ``EFFECT_GATEWAY_*`` variables.

This is the only module that knows about pydantic-settings. The core receives plain values
(:class:`gateway.policy.UpstreamPolicy`), never this object.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tomllib
from contextvars import ContextVar
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway import browser, chain
from gateway.errors import ConfigError
from gateway.headers import GATEWAY_REQUEST_HEADERS, HOP_BY_HOP, same_header
from gateway.routes import METHOD, Route

# RFC 9110 section 5.6.2: what a header name may be.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Where the gateway cannot put its key: headers that stop at a hop or that it sets or drops itself. The
# agent's Idempotency-Key is never forwarded, so the upstream's native header may share its name.
_NOT_FOR_KEYS = (HOP_BY_HOP | GATEWAY_REQUEST_HEADERS) - {"idempotency-key"}


def key_header(value: str) -> str:
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{value!r} is not a header name")
    if value.lower() in _NOT_FOR_KEYS:
        raise ValueError(f"{value!r} cannot carry the key: the gateway sets or drops that header itself")
    return value


KeyHeader = Annotated[str, AfterValidator(key_header)]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
# A century: past any retention or look-back anyone means, and far inside what timedelta and datetime
# arithmetic can hold (a huge duration would otherwise overflow where it is used).
MAX_DURATION = timedelta(days=36525)


def parse_duration(value: object) -> timedelta:
    """Read ``"90s"``, ``"24h"``, ``"7d"`` (or a number of seconds) as a timedelta."""
    if isinstance(value, timedelta):
        return value
    seconds: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = value
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds is None:
        raise ValueError(f"{value!r} is not a duration like '500ms', '90s', '10m', '24h' or '7d'")
    if not 0 <= seconds <= MAX_DURATION.total_seconds():
        raise ValueError(f"{value!r} is not a duration from 0 to {MAX_DURATION.days} days")
    return timedelta(seconds=seconds)


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


# False while loading for a command that needs only the database (see load_settings); a context variable
# because pydantic-settings passes no validation context to a settings class.
_NEED_SECRETS: ContextVar[bool] = ContextVar("need_secrets", default=True)


def resolve_secret(value: object) -> SecretStr:
    """``"env:NAME"`` reads the variable NAME at start-up; anything else is taken literally."""
    if isinstance(value, SecretStr):
        return value
    if not isinstance(value, str):
        raise ValueError("must be a string such as 'env:NAME'")
    if value.startswith("env:"):
        name = value[4:]
        if name not in os.environ:
            if not _NEED_SECRETS.get():
                return SecretStr(value)  # left unresolved: the command that loaded it never sends it
            raise ValueError(f"environment variable {name} is not set")
        value = os.environ[name]
    if not value:
        raise ValueError("must not be empty")
    return SecretStr(value)


Secret = Annotated[SecretStr, BeforeValidator(resolve_secret)]


def database_hosts(url: str) -> list[tuple[str, int | None]]:
    """The hosts of a postgresql:// URL, each with its port: one, or several for a primary and its
    standbys (``host1:5432,host2:5432``, which asyncpg tries in turn, as libpq does). Raises ValueError
    for a URL that is not postgresql:// or a port that is not a number."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError("must be a postgresql://user:password@host:port/database URL")
    hosts: list[tuple[str, int | None]] = []
    named_hosts = parts.netloc.rpartition("@")[2].split(",")
    for named in named_hosts:
        host, colon, port = named.rpartition(":") if not named.endswith("]") else (named, "", "")
        if not colon:
            host, port = named, ""
        # Never the text itself: a password with an unescaped "#" or "/" ends up here.
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(
                "a host's port is not a number from 1 to 65535 (a password with @, :, / or # must be "
                "percent-encoded)"
            )
        if not host and len(named_hosts) > 1:
            raise ValueError("a host of the list is empty")
        hosts.append((host.strip("[]"), int(port) if port else None))
    return hosts


def pooler_url(settings: Settings) -> str | None:
    """The URL of the pooler the workers' connections go through (database_url when database_direct_url
    is given too), or None when they go to Postgres itself."""
    if settings.database_direct_url is None or settings.database_url is None:
        return None
    return settings.database_url.get_secret_value()


def _postgres_url(value: SecretStr | None) -> SecretStr | None:
    """A URL asyncpg can use, checked here so that a typo is a bad setting rather than a failed connection."""
    if value is not None:
        database_hosts(value.get_secret_value())
    return value


class _Section(BaseModel):
    # A typo in a setting must stop start-up, not be ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class NativeKeySettings(_Section):
    header: KeyHeader = "Idempotency-Key"
    # Stripe prunes keys once they are 24 h old; most APIs that honour keys do the same or less.
    ttl: Duration = timedelta(hours=24)


class StampSettings(_Section):
    json_field: str | None = None
    form_field: str | None = None
    query_param: str | None = None
    header: KeyHeader | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StampSettings:
        chosen = [v for v in (self.json_field, self.form_field, self.query_param, self.header) if v]
        if len(chosen) != 1:
            raise ValueError("name exactly one of json_field, form_field, query_param, header")
        return self


def probe_route(value: str) -> str:
    Route.parse(value)  # raises with what is wrong
    return value


ProbeRoute = Annotated[str, AfterValidator(probe_route)]


class ProbeSettings(_Section):
    """The built-in HTTP probe, or a Python probe registered under ``effect_gateway.probes``."""

    method: Literal["GET", "POST", "HEAD"] = "GET"
    path: str | None = None
    found: str | None = None
    status: int = Field(default=200, ge=100, le=599)
    entry_point: str | None = None
    # How far back the upstream's search sees effects (an index that keeps 30 days, an archive that
    # moves old orders away). Past it, "not found" proves nothing and the record goes to review.
    # None: the search sees every effect the upstream ever made.
    horizon: Duration | None = None
    # How long after an effect happens the upstream's search may still not list it: a search index
    # refreshes after the write (Elasticsearch and OpenSearch every second by default), a replica lags
    # behind its primary, and Stripe's search documents that data can take up to a minute to become
    # searchable. Until then "not found" may be wrong, and sending again on it places a second order; so
    # the default is that minute, whatever the probe (HTTP or Python: the gateway cannot see how either
    # looks). Its only cost is time: a retry that finds nothing that soon gets 503 with Retry-After, and
    # one that finds the effect completes at once. "0s" only for a probe whose every answer follows every
    # write (a GET by key from the primary).
    lag: Duration = timedelta(minutes=1)
    # The requests whose effects this probe can find ("POST /orders", "POST /orders/*/refund"), required:
    # a probe searches one kind of effect, and asked about another (a refund, where it searches orders)
    # it would find nothing, and recovery would send that effect again. Requests of other routes recover
    # by the native key, then go to review (or are sent again where repeat_harmless).
    routes: list[ProbeRoute] | None = None
    # An MCP server's probe (protocol = "mcp"): a call of the read-only ``tool`` at the endpoint ``path``,
    # with ``arguments`` in which "{key}" stands for the derived key; ``found`` is where its result lists
    # the effect. ``tools`` names the tools whose effects it finds, as routes do for an HTTP probe.
    tool: str | None = None
    arguments: dict[str, Any] = Field(default_factory=dict)
    tools: list[str] | None = None

    @model_validator(mode="after")
    def _http_or_python(self) -> ProbeSettings:
        if self.tool is not None:
            return self._tool_call()
        if self.tools is not None:
            raise ValueError("tools names the tools an MCP probe finds: give the probe's own tool too")
        if self.routes is None:
            raise ValueError(
                "routes must name the requests whose effects this probe can find, such as "
                'routes = ["POST /orders"]: asked about any other request (a refund, where it searches '
                "orders) it would find nothing, and recovery would send that effect again"
            )
        if not self.routes:
            raise ValueError('routes must name at least one request, such as routes = ["POST /orders"]')
        if self.horizon is not None and self.lag >= self.horizon:
            raise ValueError(
                f"lag ({self.lag}) must be shorter than horizon ({self.horizon}): the search would never "
                "list an effect it still sees"
            )
        if self.entry_point:
            if self.path:
                raise ValueError("give either entry_point or path, not both")
            return self
        if not self.path or "{key}" not in self.path:
            raise ValueError("path must be given and contain {key}")
        if self.method == "HEAD" and self.found is not None:
            # A HEAD answer has no body to look into: any 2xx of a search, which answers whether it
            # finds the effect or not, would count as found, and an effect that never happened would be
            # completed and replayed as a success.
            raise ValueError(
                "found cannot be used with method HEAD: a HEAD answer has no body to look into; use GET "
                "for a search, or leave found out to ask for the effect by its key"
            )
        if not self.path.startswith("/"):
            raise ValueError("path must start with /")
        return self

    def _tool_call(self) -> ProbeSettings:
        if self.entry_point or self.routes is not None:
            raise ValueError("an MCP probe is a tool call: give tool and tools, not entry_point or routes")
        if not self.path or not self.path.startswith("/"):
            raise ValueError(
                'path: the MCP server\'s endpoint, where the probe calls its tool, such as "/mcp"'
            )
        if self.found is None:
            raise ValueError(
                'found: where the tool\'s result lists the effect, such as "structuredContent.orders.0"'
            )
        if "{key}" not in json.dumps(self.arguments):
            raise ValueError(
                'arguments must carry "{key}" where the tool looks for the stamped key, such as '
                'arguments = { client_reference = "{key}" }'
            )
        if not self.tools:
            raise ValueError(
                'tools must name the tools whose effects this probe finds, such as tools = ["place_order"]: '
                "asked about another tool's effect it would find nothing, and recovery would call that "
                "tool again"
            )
        return self


KeylessMode = Literal["refuse", "audit", "forward"]
ErrorFormat = Literal["problem+json", "stripe"]
# Reading does not change anything upstream: these pass through without a key, untracked.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Without a key the gateway cannot make these safe to retry, so by default they are refused; every
# other unsafe method (PUT, DELETE, ...) is forwarded and audited unless the upstream says otherwise.
KEYLESS_DEFAULTS: dict[str, KeylessMode] = {"POST": "refuse", "PATCH": "refuse"}


# What a browser sends as Origin: a scheme, a host and an optional port, nothing after them.
_ORIGIN = re.compile(r"^https?://[^/?#\s@]+$")


def browser_origin(value: str) -> str:
    if value == "null":
        # Sandboxed frames, local files and redirects all send "null": listing it admits any page.
        raise ValueError("'null' cannot be listed: any sandboxed page or local file sends it")
    if not _ORIGIN.match(value) or value != value.lower():
        raise ValueError(f"{value!r} is not an origin such as https://app.example.com (lower case, no path)")
    why = browser.origin_flaw(value)
    if why is not None:
        raise ValueError(f"{value!r} is never what a browser sends: {why}")
    return value


BrowserOrigin = Annotated[str, AfterValidator(browser_origin)]


class UpstreamSettings(_Section):
    base_url: str
    # Long enough for a slow payment API, short enough that an agent is not left hanging.
    timeout: Duration = timedelta(seconds=30)
    native_key: NativeKeySettings | None = None
    stamp: StampSettings | None = None
    probe: ProbeSettings | None = None
    # Set only for upstreams whose duplicates do no harm (e.g. a PUT of the same document).
    repeat_harmless: bool = False
    # The web origins (scheme://host[:port]) whose pages may call this upstream through the gateway from a
    # browser. None by default: a browser's request carries the secrets the gateway injects, and any page
    # the person has open could send it.
    browser_origins: list[BrowserOrigin] = Field(default_factory=list)
    inject_headers: dict[str, Secret] = Field(default_factory=dict)
    # Headers an agent may send that carry secrets: forwarded, never stored or fingerprinted.
    secret_headers: list[str] = Field(default_factory=list)
    # Request headers that change what the upstream does, so a different value is a different request.
    fingerprint_headers: list[str] = Field(default_factory=lambda: ["content-type"])
    # Requests without an Idempotency-Key, by method: "refuse" (400), "audit" (forwarded once, with an
    # audit row; a retry is a new request) or "forward" (untracked: no row at all).
    keyless: dict[str, KeylessMode] = Field(default_factory=dict)
    # Connections this gateway opens to the upstream at once (probes included); each upstream has its
    # own, so one that hangs cannot starve the others. 100 is aiohttp's own default for a whole client,
    # more effects in flight to one API than an agent fleet behind one sidecar makes.
    max_connections: int = Field(default=100, ge=1)
    # How long a request waits for one of those connections (or to open one) before it is refused
    # unsent (502 upstream-unreachable, safe to retry): a healthy upstream frees one in milliseconds.
    connect_timeout: Duration = timedelta(seconds=5)
    # The shape of the gateway's own errors on this upstream's routes: RFC 9457 problem+json, or Stripe's
    # {"error": {...}} with the statuses stripe-python maps to its exceptions (gateway/error_shapes.py).
    error_format: ErrorFormat = "problem+json"
    # Refuse keys shaped like a UUID (what SDKs make up per call) where only step keys are wanted.
    refuse_random_keys: bool = False
    # The body fields the fingerprint covers (JSON dotted paths, form field names), or the volatile ones it
    # leaves out; at most one of the two. None: the whole body.
    fingerprint_fields: list[str] | None = None
    fingerprint_ignore: list[str] | None = None
    # "http": each request is a call of an HTTP API. "mcp": base_url is an MCP server's streamable HTTP
    # endpoint; each tools/call of a tool with side effects is an effect, keyed and replayed, and every
    # other message passes through unrecorded (gateway/mcp.py).
    protocol: Literal["http", "mcp"] = "http"
    # MCP: the tools whose side effects the operator states ("effect" or "read_only"), over what the
    # server's annotations say; a tool named nowhere is an effect.
    tools: dict[str, Literal["effect", "read_only"]] = Field(default_factory=dict)

    # The two checks below refuse what would let recovery send an effect twice (docs/recovery.md has the
    # table of combinations). Each names the setting at fault, so each checks one field against the
    # fields declared before it: ``info.data`` holds those that are valid, and a default counts as given.

    @field_validator("probe")
    @classmethod
    def _probe_can_find_the_key(
        cls, probe: ProbeSettings | None, info: ValidationInfo
    ) -> ProbeSettings | None:
        # A probe, HTTP or Python, has only the derived key to look for. Where it never reached the upstream
        # the probe finds nothing, ever, and recovery takes that "not found" as leave to send again.
        # (Where native_key or stamp is invalid, that error is the one to report.)
        unsent = all(name in info.data and info.data[name] is None for name in ("native_key", "stamp"))
        if probe is not None and unsent:
            raise ValueError(
                "the probe looks for the effect by its key, but no stamp or native_key sends it to the "
                "upstream: the probe would never find an effect, and recovery would send it again; add a "
                "stamp where the probe's search sees it"
            )
        return probe

    @field_validator("inject_headers")
    @classmethod
    def _keys_not_replaced(cls, inject: dict[str, SecretStr], info: ValidationInfo) -> dict[str, SecretStr]:
        # Injected headers replace whatever else the request carries under their name (gateway.upstream), so
        # one that shares the native key's or the stamp's name replaces the effect's key with a constant.
        injected = {same_header(name): name for name in inject}
        native: NativeKeySettings | None = info.data.get("native_key")
        stamp: StampSettings | None = info.data.get("stamp")
        if native is not None and (name := injected.get(same_header(native.header))):
            raise ValueError(
                f"{name} replaces the key the gateway sends in native_key.header: the upstream would get "
                "the injected value in place of each effect's key, and could not tell a re-send of one "
                "effect from another effect; inject another header"
            )
        if stamp is not None and stamp.header and (name := injected.get(same_header(stamp.header))):
            raise ValueError(
                f"{name} replaces the key stamped in stamp.header: the upstream would never see it, so a "
                "probe could not find the effect and recovery would send it again; stamp another header"
            )
        return inject

    @model_validator(mode="after")
    def _check(self) -> UpstreamSettings:
        if self.fingerprint_fields is not None and self.fingerprint_ignore is not None:
            raise ValueError("give fingerprint_fields or fingerprint_ignore, not both")
        for name, fields in (
            ("fingerprint_fields", self.fingerprint_fields),
            ("fingerprint_ignore", self.fingerprint_ignore),
        ):
            if fields is not None and not fields:
                raise ValueError(f"{name} must list at least one field; leave it out to cover the whole body")
            for path in fields or ():
                if not path or "" in path.split("."):
                    raise ValueError(f"{name}: {path!r} is not a field name or a dotted path such as a.b")
        for method in self.keyless:
            if not METHOD.match(method):
                raise ValueError(f"keyless: {method!r} is not an HTTP method in capitals, such as PUT")
            if method in SAFE_METHODS:
                raise ValueError(f"keyless: {method} always passes through; only unsafe methods are listed")
        if not re.match(r"^https?://[^/?#\s]+(/[^?#\s]*)?$", self.base_url):
            raise ValueError(f"base_url {self.base_url!r} must be an http:// or https:// URL without query")
        if self.timeout <= timedelta(0) or self.connect_timeout <= timedelta(0):
            raise ValueError("timeout and connect_timeout must be positive")
        if self.protocol == "http" and (self.tools or (self.probe is not None and self.probe.tool)):
            raise ValueError('tools and probe.tool name an MCP server\'s tools: set protocol = "mcp"')
        if self.protocol == "mcp":
            self._check_mcp()
        return self

    def _check_mcp(self) -> None:
        # A tool call's fingerprint is its tool and arguments, and its key comes with the call: the
        # settings that shape an HTTP request's would say nothing here, or something untrue.
        for name in ("fingerprint_fields", "fingerprint_ignore"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: an MCP tool call's fingerprint is its tool's name and arguments")
        if self.keyless:
            raise ValueError("keyless: an MCP tool call with side effects needs a key; read-only tools pass")
        if self.probe is not None and self.probe.tool is None:
            raise ValueError(
                'probe: an MCP server is probed with a read-only tool call: probe = { path = "/mcp", '
                'tool = "find_orders", arguments = { client_reference = "{key}" }, found = "...", '
                'tools = ["place_order"] }'
            )
        if self.probe is not None and self.stamp is None:
            raise ValueError(
                "probe: the probe's tool finds a call by the key stamped into its arguments: add stamp = "
                '{ json_field = "params.arguments.client_reference" } (an argument the tool keeps)'
            )
        if self.stamp is not None and not (
            self.stamp.json_field and self.stamp.json_field.startswith(("params.arguments.", "params._meta."))
        ):
            raise ValueError(
                "stamp: an MCP tool call carries its key in its arguments or its _meta: a json_field such as "
                "params.arguments.client_reference"
            )


class TenantSettings(_Section):
    token: Secret


class AdminSettings(_Section):
    token: Secret | None = None
    # A reverse proxy that signs people in (oauth2-proxy and the like) names them in this header. It is
    # believed only from trusted_proxies, and only for a name configured under [operators]: the proxy
    # says who, the configuration what they may do.
    operator_header: str | None = None
    trusted_proxies: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _proxies(self) -> AdminSettings:
        if self.operator_header is not None:
            if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", self.operator_header):
                raise ValueError(f"operator_header {self.operator_header!r} is not a header name")
            if not self.trusted_proxies:
                raise ValueError(
                    "operator_header needs trusted_proxies: the addresses of the proxies whose word is "
                    "taken (anyone else could send the header)"
                )
        for network in self.trusted_proxies:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"trusted_proxies: {network!r} is not an address or a network") from None
        return self


class OperatorSettings(_Section):
    """A person who reads and resolves effects under their own name, which every verdict records."""

    token: Secret
    # The one tenant whose effects they see and resolve, or several (tenants); neither: every tenant's.
    tenant: str | None = None
    tenants: list[str] | None = None

    @model_validator(mode="after")
    def _one_way(self) -> OperatorSettings:
        if self.tenant is not None and self.tenants is not None:
            raise ValueError("give tenant (one) or tenants (a list), not both")
        if self.tenants is not None and not self.tenants:
            raise ValueError("tenants is empty: an operator who may see no tenant is none (omit it for all)")
        return self

    @property
    def scope(self) -> frozenset[str] | None:
        """The tenants whose effects they see and resolve; None: every tenant's."""
        if self.tenant is not None:
            return frozenset({self.tenant})
        return frozenset(self.tenants) if self.tenants is not None else None


class AuditSettings(_Section):
    """The audit's chain (gateway.chain): how often settlements enter it, and the key that signs it."""

    # An Ed25519 private key (`effect-gateway audit new-key` makes one): hex, base64 or a PEM block, as
    # "env:NAME" best. Omitted: the chain is kept but its heads are not signed, and nothing shows that it
    # was not rewritten whole.
    signing_key: Secret | None = None
    # How long a tenant's moved head waits for its next signature: signing costs a row an hour per tenant,
    # and an export signs the head it ends at whenever it runs.
    sign_every: Duration = timedelta(hours=1)
    # How often the settlements enter the chain: a second keeps the chain close behind the audit, and
    # the table of settlements waiting for it to a second's worth.
    chain_every: Duration = timedelta(seconds=1)

    @field_validator("signing_key")
    @classmethod
    def _a_signing_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().startswith("env:"):
            chain.signing_key(key.get_secret_value())  # raises ValueError saying what it expected
        return key

    @field_validator("chain_every")
    @classmethod
    def _chain_now_and_then(cls, every: timedelta) -> timedelta:
        # Each round is a transaction on the workers' pool: not in a tight loop, and at least each minute
        # so that an export or a verdict shows up in the chain soon.
        if not timedelta(milliseconds=100) <= every <= timedelta(minutes=1):
            raise ValueError("must be from 100ms to 1m")
        return every

    @field_validator("sign_every")
    @classmethod
    def _sign_now_and_then(cls, every: timedelta) -> timedelta:
        # A head a second is a row a second per tenant, for ever: a minute is as often as that is worth.
        if every < timedelta(minutes=1):
            raise ValueError("must be 1m or more: each signature is a row kept for ever")
        return every


def webhook_url(value: SecretStr) -> SecretStr:
    if not _NEED_SECRETS.get() and value.get_secret_value().startswith("env:"):
        return value  # left unresolved for a command that never sends (see resolve_secret)
    # Never the URL itself in the message: a Slack incoming webhook's URL is its credential.
    if not re.match(r"^https?://[^/?#\s]+(/[^#\s]*)?$", value.get_secret_value()):
        raise ValueError("must be an http:// or https:// URL (give it as 'env:NAME' when it holds a secret)")
    return value


class WebhookSettings(_Section):
    """Where the gateway tells an operator of effects that wait for them (gateway.notifications)."""

    # A Slack incoming webhook's URL is its own credential: like a token, it may be "env:NAME", and the
    # gateway never logs or stores it.
    url: Annotated[Secret, AfterValidator(webhook_url)]
    # "json": the gateway's own document; "slack": {"text": ...}, which Slack's incoming webhooks (and
    # Mattermost's, Rocket.Chat's, Discord's /slack endpoint) post as a message.
    shape: Literal["json", "slack"] = "json"
    # Sent as Authorization: Bearer; never logged or stored.
    token: Secret | None = None
    # An effect in doubt recovers by itself on its agent's next retry, usually within seconds; one in
    # doubt an hour later has an agent that gave up or died. The hour is the alert rules' own (a ticket).
    in_doubt_after: Duration = timedelta(hours=1)
    # How often a worker looks for new waits and sends what is due. Review pages someone (the alert
    # rules page after two minutes): 15 s tells them well before, for one small read of open_effects.
    interval: Duration = timedelta(seconds=15)
    # One delivery's whole time, connecting included. Slack answers in well under a second; 10 s rides
    # out a slow receiver without holding a notification long.
    timeout: Duration = timedelta(seconds=10)
    # The wait after the first failed delivery; it doubles after each, up to 15 minutes
    # (gateway.notifications.LONGEST_WAIT). 10 s lets a receiver's brief hiccup (a deploy, a 502 of its
    # proxy) pass, and is long enough not to hammer one that is down.
    retry_after: Duration = timedelta(seconds=10)
    # Past this since the wait was noticed, a notification that never got through is given up (logged,
    # and recorded). A day covers a receiver down overnight; later than that the alert rules and the
    # audit page's banner have long told someone.
    give_up_after: Duration = timedelta(hours=24)
    # Where operators reach the admin listener (https://gateway.example:8788): each notification then
    # links to the effect's audit page. Omitted: only its path is sent (the gateway cannot know the
    # address a person uses to reach it).
    admin_url: str | None = None

    @field_validator("in_doubt_after", "interval", "timeout", "retry_after")
    @classmethod
    def _some_time(cls, value: timedelta) -> timedelta:
        # None of these means anything at 0s: every wait in doubt told at once, a sweep in a tight
        # loop, a delivery that cannot succeed, retries with no pause.
        if value <= timedelta(0):
            raise ValueError("must be more than 0s")
        return value

    @model_validator(mode="after")
    def _timings(self) -> WebhookSettings:
        if self.give_up_after < self.retry_after:
            raise ValueError("give_up_after must be at least retry_after, or no delivery would be retried")
        if self.admin_url is not None and not re.match(r"^https?://[^/?#\s]+/?$", self.admin_url):
            raise ValueError(
                f"admin_url {self.admin_url!r} must be the admin listener's http:// or https:// address "
                "without a path"
            )
        return self


_UPSTREAM_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="EFFECT_GATEWAY_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    listen: str = "127.0.0.1:8787"
    # The audit page, the effects API and the metrics have a listener of their own: nothing an upstream
    # answers is ever served on the operator's origin, where a script in it would act with their session.
    admin_listen: str = "127.0.0.1:8788"
    # Worker processes serving the two listening sockets; None: one per CPU the process may use (its
    # cores, or its cgroup's CPU quota rounded up: gateway.cores). Each worker has its own connection
    # pool (pool_size) and replay cache (replay_cache_bytes).
    workers: int | None = Field(default=None, ge=1)
    # The workers' event loop: "uvloop" (the extra `fast`), "asyncio", or "auto": uvloop when installed.
    event_loop: Literal["auto", "asyncio", "uvloop"] = "auto"
    database_url: Annotated[SecretStr | None, AfterValidator(_postgres_url)] = None
    # Postgres itself (or a pooler in session mode), when database_url goes through a pooler such as
    # PgBouncer. The workers' pool then goes through the pooler with nothing a pooler in transaction
    # mode would lose between transactions (no named prepared statements, no settings sent at login),
    # and whatever holds a session-level lock goes here: the migrations, the partitions' upkeep, the
    # commands. Such a lock taken through a transaction pooler stays on a server connection that
    # other clients then use.
    database_direct_url: Annotated[SecretStr | None, AfterValidator(_postgres_url)] = None
    data_dir: Path = Path(".effect-gateway")
    retention: Duration = timedelta(days=7)
    # How often serve drops bodies past the retention; an hour keeps the table small without busy work.
    purge_interval: Duration = timedelta(hours=1)
    # Added to each upstream's timeout to make its lease: time for the gateway to write down what it saw.
    lease_grace: Duration = timedelta(seconds=5)
    # 1 MiB: larger than any JSON or form API call an agent makes, small enough to hold many in memory.
    max_body_bytes: int = Field(default=1024 * 1024, gt=0)
    # Content-Encoding layers a request body may have. Each layer is decoded whole (up to max_body_bytes),
    # so the work grows with their number; clients compress once, and 10,000 gzip layers in a megabyte
    # took 5 s. 0 refuses every encoded body.
    max_content_codings: int = Field(default=1, ge=0)
    # 10 MiB: responses are stored for replay; a bigger one is a download, not an effect.
    max_response_bytes: int = Field(default=10 * 1024 * 1024, gt=0)
    # Postgres connections per gateway process: the hot path holds one for a statement at a time, so
    # 20 serve hundreds of requests in flight; Postgres's default max_connections is 100.
    pool_size: int = Field(default=20, ge=1)
    # A stuck statement or a pool with no free connection is answered 503 after this long instead of
    # stalling the gateway: every statement of the hot path takes milliseconds.
    pool_timeout: Duration = timedelta(seconds=5)
    statement_timeout: Duration = timedelta(seconds=10)
    # Rows are locked for one statement at a time, never across an upstream call.
    lock_timeout: Duration = timedelta(seconds=2)
    # Completed effects kept in memory per process for replays without a round trip to Postgres.
    replay_cache_bytes: int = Field(default=32 * 1024 * 1024, ge=0)
    # The upper bound for Prefer: wait=N; a longer hold ties up a connection for nothing.
    max_wait: Duration = timedelta(seconds=60)
    # Requests of one process that may wait for one key at once; the next is answered 409 in-flight at
    # once. A key is one step of one agent: its retries, or a burst of the same call, come in tens at
    # most. Each waiter reads the record up to 5 times a second, so 64 cost Postgres at most 320 reads
    # a second per key, and only while the call they wait for is in flight.
    max_waiters_per_key: int = Field(default=64, ge=1)
    # The secret of the keyed MAC that derives upstream keys; omitted: one made at the first migration
    # and kept in the database, which every gateway on it shares. Changing it changes the keys of new
    # effects only (each record keeps the key it was sent with).
    key_secret: Secret | None = None
    # A connection must deliver a whole request head within this time of opening (or of its previous
    # answer), else it is closed: a peer that stalls mid-head holds a socket no longer. It is also how
    # long an idle keep-alive connection stays open (aiohttp has one timer for both), longer than the
    # 5 s and 15 s that httpx and aiohttp clients keep theirs, so the client closes first and never
    # reuses a connection the gateway has just closed. Apache's default for a request head is 20 s.
    request_head_timeout: Duration = timedelta(seconds=20)
    # The whole body (at most max_body_bytes) must arrive within this time of its head, else 408 and
    # nothing is claimed or sent. 1 MiB in 20 s is 50 KiB/s, far below any agent's link to its sidecar;
    # it also bounds how long a stalled upload can hold a shutdown.
    request_body_timeout: Duration = timedelta(seconds=20)
    # "json", "text", or "auto": text when stderr is a terminal (a person reads it), JSON lines
    # otherwise (a supervisor hands them to a log pipeline, which parses JSON).
    log_format: Literal["auto", "json", "text"] = "auto"
    # The level of the line per decision for a request that went as it should (sent and answered, or
    # replayed, below 500): "debug" leaves those lines out unless the log is verbose, so the log holds
    # what needs a look (recoveries, refusals, failures, upstreams' 5xx, effects in doubt); the audit
    # keeps every effect either way.
    routine_decisions: Literal["info", "debug"] = "info"
    tenants: dict[str, TenantSettings] = Field(default_factory=dict)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    operators: dict[str, OperatorSettings] = Field(default_factory=dict)
    audit: AuditSettings = Field(default_factory=AuditSettings)
    upstreams: dict[str, UpstreamSettings] = Field(default_factory=dict)
    # Omitted: nothing is sent, and no worker looks for waiting effects (no cost at all).
    webhook: WebhookSettings | None = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's contents arrive as init arguments (see load_settings); variables override the file.
        return (env_settings, init_settings)

    @field_validator("upstreams")
    @classmethod
    def _no_page_of_the_gateway(
        cls, upstreams: dict[str, UpstreamSettings], info: ValidationInfo
    ) -> dict[str, UpstreamSettings]:
        # Every upstream's pages are served on the agents' listener: with its origin listed, a script in any
        # of them calls this upstream same-origin, with the credentials the gateway injects. The admin
        # listener serves the audit, whose pages call no upstream.
        served = {
            "listen": "the gateway's own address, where every upstream's pages are served: a script in any "
            "of them could call {name} with the credentials the gateway injects",
            "admin_listen": "the gateway's admin address, where the audit is served: no page of the "
            "gateway's own may call {name} with the credentials it injects",
        }
        for setting, where in served.items():
            address = info.data.get(setting)
            try:
                host, port = listen_host(str(address), setting), listen_port(str(address))
            except ValueError:
                continue  # the address itself is reported by _check
            for name, upstream in upstreams.items():
                for origin in upstream.browser_origins:
                    if browser.served_at(origin, host, port):
                        raise ValueError(
                            f"{name}.browser_origins: {origin!r} is {setting} {address!r}, "
                            + where.format(name=name)
                        )
        return upstreams

    @field_validator("purge_interval")
    @classmethod
    def _purge_now_and_then(cls, interval: timedelta) -> timedelta:
        # Each round also makes the partitions ahead (14 days of bodies): a round at least daily keeps
        # them well ahead. Each round opens a connection of its own: none between rounds (0s) would do
        # that in a tight loop; a second apart is already far more often than the retention needs.
        if not timedelta(seconds=1) <= interval <= timedelta(days=1):
            raise ValueError(
                "must be from 1s to 24h: each round also makes the partitions ahead, so at least daily, "
                "and each opens a connection to Postgres, so not in a tight loop"
            )
        return interval

    @field_validator("lease_grace")
    @classmethod
    def _some_grace(cls, grace: timedelta) -> timedelta:
        # The grace is also the most that may pass between the claim and the request leaving: with none,
        # every keyed request is late, taken again, and in the end refused unsent.
        if grace <= timedelta(0):
            raise ValueError(
                "must be more than 0s: it is also the time a claimed request has to leave, and with none "
                "no keyed request would ever be sent"
            )
        return grace

    @model_validator(mode="after")
    def _check(self) -> Settings:
        listen_host(self.listen)  # raises with a clear message
        if self.database_direct_url is not None and self.database_url is None:
            raise ValueError(
                "database_direct_url is set without database_url: give database_url the pooler's URL, "
                "or drop database_direct_url to connect to Postgres directly"
            )
        if self.request_head_timeout <= timedelta(0) or self.request_body_timeout <= timedelta(0):
            raise ValueError("request_head_timeout and request_body_timeout must be positive")
        for name in self.upstreams:
            if not _UPSTREAM_NAME.match(name) or name.startswith("_"):
                raise ValueError(f"upstream name {name!r} must be lower-case letters, digits, - or _")
        for name in self.tenants:
            if not _UPSTREAM_NAME.match(name):
                raise ValueError(f"tenant name {name!r} must be lower-case letters, digits, - or _")
        for name, operator in self.operators.items():
            if not _UPSTREAM_NAME.match(name) or name == "admin":
                raise ValueError(
                    f"operator name {name!r} must be lower-case letters, digits, - or _, and not admin "
                    "(a verdict by the admin token is recorded as admin)"
                )
            for tenant in sorted(operator.scope or ()):
                if tenant not in self.tenants:
                    which = "tenant" if operator.tenant is not None else "tenants"
                    raise ValueError(f"operators.{name}.{which}: {tenant!r} is not a configured tenant")
        _distinct_tokens(self.tenants, self.admin.token, self.operators)
        if not self.tenants and not is_loopback(listen_host(self.listen)):
            raise ValueError(
                f"listen {self.listen!r} is beyond loopback: configure [tenants] so agents present a token"
            )
        admin_host = listen_host(self.admin_listen, "admin_listen")
        if self.admin_open and not is_loopback(admin_host):
            raise ValueError(
                f"admin_listen {self.admin_listen!r} is beyond loopback: configure [admin] token so "
                "operators present one"
            )
        if self.admin_listen == self.listen and listen_port(self.listen) != 0:
            raise ValueError(
                f"admin_listen and listen are both {self.listen!r}: the admin routes need a listener of "
                "their own, so that no upstream's page is ever served on the operator's origin"
            )
        return self

    @property
    def admin_open(self) -> bool:
        """Whether the admin routes answer without a token: a single-tenant gateway with no admin token
        and no named operators (with them, every verdict must name one)."""
        return self.admin.token is None and not self.tenants and not self.operators


def _distinct_tokens(
    tenants: dict[str, TenantSettings], admin: SecretStr | None, operators: dict[str, OperatorSettings]
) -> None:
    """A token says who the caller is: shared, one tenant's requests are another's, a tenant is admin, or
    a verdict names the wrong person."""
    holder: dict[str, str] = {}
    held = [(f"tenant {name}", t.token) for name, t in tenants.items()]
    held += [(f"operator {name}", o.token) for name, o in operators.items()]
    held += [("the admin", admin)] if admin is not None else []
    for who, token in held:
        if (first := holder.setdefault(token.get_secret_value(), who)) != who:
            raise ValueError(f"{first} and {who} have the same token; each needs its own")


def listen_host(listen: str, setting: str = "listen") -> str:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise ValueError(f"{setting} {listen!r} must be HOST:PORT")
    return host.strip("[]")


def listen_port(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_settings(
    config: Path | str | None = None, *, need_secrets: bool = True, **overrides: Any
) -> Settings:
    """Read the TOML file (``--config`` or ``EFFECT_GATEWAY_CONFIG``) and the environment.

    A relative ``data_dir`` in the file is relative to the file's folder (one from a variable or an
    override, to the current directory). With ``need_secrets=False`` (commands that only read and write
    the database) an ``env:`` secret whose variable is unset is left unresolved instead of refused.
    Raises :class:`ConfigError` with one line naming the bad settings.
    """
    path = config or os.environ.get("EFFECT_GATEWAY_CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start})") from None
        if isinstance(data.get("data_dir"), str):
            data["data_dir"] = Path(path).resolve().parent / data["data_dir"]
    data.update(overrides)
    token = _NEED_SECRETS.set(need_secrets)
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_one_line(exc)) from None
    finally:
        _NEED_SECRETS.reset(token)


def _one_line(exc: ValidationError) -> str:
    """Every bad setting, on one line: the first in full, the rest by name and message."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "configuration"
        problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    if len(problems) == 1:
        return f"bad setting {problems[0]}"
    return f"bad setting {problems[0]} (and {len(problems) - 1} more: {'; '.join(problems[1:])})"
