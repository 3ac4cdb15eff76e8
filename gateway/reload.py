"""What a reload (SIGHUP) may change in a running gateway, and what it must refuse.

:func:`compare` is pure: two validated configurations in, the settings that differ out, each either
applied or refused with the reason. What may change is only what no effect in flight depends on:

- who may call: the tenants' tokens, the admin token, the named operators' tokens (and which tenant an
  operator sees). Each request checks its caller once, as it arrives, against the tokens of that
  moment; the audit page's sessions carry a fingerprint of the token they were signed in with, read
  against the configured tokens on every request, so a session of a removed or rotated token ends.
  Whether the gateway asks for tokens at all may not change: each listener chose its checks at start.
- an upstream's ``timeout`` (and with it its lease, the timeout plus ``lease_grace``). A request reads
  its upstream's policy once, as it arrives, and claims and sends with that one policy: its lease is
  written into the record with the claim, another worker takes a pending record over only once that
  written lease ran out, a probe's lag counts from the lease the attempt recorded, and the native
  key's margin is the lease of the request that re-sends. Shutdown waits for the longest lease any
  call in flight may hold (gateway.runtime).
- the values of an upstream's ``inject_headers`` (its credentials): sent, never stored or
  fingerprinted. Their names may not change: they decide what is kept out of the record.

Everything else is refused, with a reason: what decides whether an effect may be sent again (a native
key's TTL, the lease grace, a probe, a stamp, the fingerprint, the retention) because the effects in
flight were claimed under the old value, and for a while the workers would not agree on it; what is
bound at start (the sockets, the database, the workers, the pools) because only a restart changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pydantic import SecretStr

from gateway.errors import ConfigError
from gateway.settings import Settings

# A setting's place in the configuration, as the file spells it: ("upstreams", "shop", "timeout").
SettingPath = tuple[str, ...]
# Matches any one name: a tenant's, an operator's, an upstream's, a header's.
ANY = "*"


class _Absent:
    """The value of a setting on the side where it is not there (a tenant added, an operator removed)."""

    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()

# What may change while the gateway serves. ``True``: it may also appear or disappear (a tenant or
# an operator added or removed); ``False``: only its value may change.
MAY_CHANGE: dict[SettingPath, bool] = {
    ("tenants", ANY, "token"): True,
    ("operators", ANY, "token"): True,
    ("operators", ANY, "tenant"): True,
    ("operators", ANY, "tenants"): True,
    ("admin", "token"): False,
    ("upstreams", ANY, "timeout"): False,
    ("upstreams", ANY, "inject_headers", ANY): False,
}

_BOUND_AT_START = "it is bound when the gateway starts (restart to change it)"
_DECIDES = (
    "it decides whether an effect may be sent again, and the effects in flight were claimed under the "
    "old value: meanwhile the workers would disagree on it, and one could send an effect twice "
    "(restart to change it)"
)
# Why a setting is refused, by the first of these its path starts with (else _BOUND_AT_START).
WHY_NOT: dict[SettingPath, str] = {
    ("listen",): "the gateway's sockets are bound at start (restart to change it)",
    ("admin_listen",): "the gateway's sockets are bound at start (restart to change it)",
    ("workers",): "the worker processes are started with it (restart to change it)",
    ("database_url",): "the connections to Postgres are opened at start (restart to change it)",
    ("database_direct_url",): "the connections to Postgres are opened at start (restart to change it)",
    ("data_dir",): "the embedded Postgres is started from it (restart to change it)",
    ("key_secret",): "the keys sent upstream, the log's key hashes and the audit's sessions are derived "
    "from it at start (restart to change it)",
    ("lease_grace",): _DECIDES,
    ("retention",): _DECIDES,
    ("upstreams", ANY, "native_key"): _DECIDES,
    ("upstreams", ANY, "probe"): _DECIDES,
    ("upstreams", ANY, "stamp"): _DECIDES,
    ("upstreams", ANY, "repeat_harmless"): _DECIDES,
    ("upstreams", ANY, "base_url"): _DECIDES,
    ("upstreams", ANY, "fingerprint_headers"): _DECIDES,
    ("upstreams", ANY, "fingerprint_fields"): _DECIDES,
    ("upstreams", ANY, "fingerprint_ignore"): _DECIDES,
    ("upstreams", ANY, "secret_headers"): _DECIDES,
    ("upstreams", ANY, "inject_headers"): "the names of injected headers decide what is never stored "
    "(restart to change them)",
    ("upstreams", ANY, "keyless"): _DECIDES,
    ("upstreams", ANY, "protocol"): _DECIDES,
    ("upstreams", ANY, "tools"): _DECIDES,
    ("upstreams", ANY, "connect_timeout"): "each upstream's connection pool is made with it at start "
    "(restart to change it)",
    ("upstreams", ANY, "max_connections"): "each upstream's connection pool is made with it at start "
    "(restart to change it)",
    ("upstreams",): "the upstreams are set up at start (restart to add or remove one)",
    ("tenants",): "whether agents present a token is chosen when the agents' listener starts (restart "
    "to change it)",
    ("admin",): "whether operators present a token is chosen when the admin listener starts (restart "
    "to change it)",
}


@dataclass(frozen=True, slots=True)
class Change:
    """A setting that differs: its values before and after (ABSENT on the side where it is not)."""

    path: SettingPath
    before: Any
    after: Any

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def on_both_sides(self) -> bool:
        return self.before is not ABSENT and self.after is not ABSENT

    def describe(self) -> str:
        """The setting's name, and for a value that is no secret, what it was and is now."""
        if self.before is ABSENT:
            return f"{self.name} (added)"
        if self.after is ABSENT:
            return f"{self.name} (removed)"
        if isinstance(self.before, SecretStr) or isinstance(self.after, SecretStr):
            return self.name  # never a token's value, nor a hint of it
        return f"{self.name} ({_shown(self.before)} -> {_shown(self.after)})"


@dataclass(frozen=True, slots=True)
class Refusal:
    setting: str
    reason: str


@dataclass(frozen=True, slots=True)
class Comparison:
    """What differs between the running configuration and the one read again."""

    applied: tuple[Change, ...]
    refused: tuple[Refusal, ...]


def compare(running: Settings, new: Settings) -> Comparison:
    """Sort every setting that differs into what may be applied and what must be refused.

    Nothing is applied when anything is refused: a reload takes the whole file or none of it, so that
    the configuration running is always one that was written down.
    """
    refused: list[Refusal] = []
    if bool(running.tenants) != bool(new.tenants):
        refused.append(Refusal("tenants", WHY_NOT[("tenants",)]))
    if running.admin_open != new.admin_open:
        refused.append(Refusal("admin.token", WHY_NOT[("admin",)]))
    applied: list[Change] = []
    for change in _changes(_leaves(running), _leaves(new)):
        if _may_change(change):
            applied.append(change)
        else:
            refused.append(Refusal(change.name, _why_not(change.path)))
    if refused:
        unique = {refusal.setting: refusal for refusal in reversed(refused)}
        return Comparison((), tuple(reversed(unique.values())))
    return Comparison(tuple(applied), ())


def _may_change(change: Change) -> bool:
    for pattern, may_come_and_go in MAY_CHANGE.items():
        if _matches(change.path, pattern, whole=True):
            return may_come_and_go or change.on_both_sides
    return False


def _why_not(path: SettingPath) -> str:
    for pattern, why in WHY_NOT.items():
        if _matches(path, pattern, whole=False):
            return why
    return _BOUND_AT_START


def _matches(path: SettingPath, pattern: SettingPath, *, whole: bool) -> bool:
    if len(path) < len(pattern) or (whole and len(path) != len(pattern)):
        return False
    return all(want in (ANY, have) for have, want in zip(path, pattern, strict=False))


def _leaves(settings: Settings) -> dict[SettingPath, Any]:
    """Every setting, by its path, down to the values (a section absent is None at its own path)."""
    return dict(_walk((), settings.model_dump()))


def _walk(path: SettingPath, value: Any) -> Iterator[tuple[SettingPath, Any]]:
    if isinstance(value, Mapping) and (value or not path):
        for key, inner in value.items():
            yield from _walk((*path, str(key)), inner)
    else:
        yield path, value


def _changes(before: dict[SettingPath, Any], after: dict[SettingPath, Any]) -> Iterator[Change]:
    for path in sorted(before.keys() | after.keys()):
        old, new = before.get(path, ABSENT), after.get(path, ABSENT)
        if old is ABSENT or new is ABSENT or old != new:
            yield Change(path, old, new)


def _shown(value: Any) -> str:
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}s"
    return repr(value)


def applied_line(comparison: Comparison) -> str:
    """The log line of a worker that applied a reload: which settings changed, never a token's value."""
    if not comparison.applied:
        return "configuration reloaded: nothing changed"
    return "configuration reloaded: " + "; ".join(change.describe() for change in comparison.applied)


def refused_line(refusals: tuple[Refusal, ...]) -> str:
    """The one log line of a refused reload: each setting that may not change, and why."""
    said = "; ".join(f"{r.setting} changed, but {r.reason}" for r in refusals)
    return f"configuration not reloaded, going on with the one running: {said}"


def invalid_line(error: str) -> str:
    """The one log line of a reload whose file (or environment) does not validate."""
    return f"configuration not reloaded, going on with the one running: {error}"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a configuration read again: apply ``settings``, or (None) go on as before;
    ``line`` is what to log, either way."""

    settings: Settings | None
    line: str


def read_again(running: Settings, reread: Callable[[], Settings]) -> Verdict:
    """Read the configuration again (``reread``: the file and the environment, as at start), validate
    it whole, and judge it against the one running."""
    try:
        new = reread()
    except ConfigError as exc:
        return Verdict(None, invalid_line(str(exc)))
    comparison = compare(running, new)
    if comparison.refused:
        return Verdict(None, refused_line(comparison.refused))
    return Verdict(new, applied_line(comparison))
