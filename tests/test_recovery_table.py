"""docs/recovery.md's table of configurations holds: every combination of native key, stamp, probe and
repeat_harmless is refused at load, or recovers an effect in doubt in the order the table says."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent_example.crash_matrix import gateway_config
from gateway.decision import Action, Policy, Probe, Resend, Review, Send, Settlement, after_probe, decide
from gateway.errors import ConfigError
from gateway.outcome import NotFound
from gateway.policy import upstream_policy
from gateway.record import EffectRecord
from gateway.report import protection
from gateway.settings import load_settings
from gateway.states import State
from tests.doc_blocks import ROOT
from tests.factories import NOW, SAME, record

PAGE = ROOT / "docs" / "recovery.md"
HEADER = (
    "| native key | stamp | probe | `repeat_harmless` | at load | on the probe's routes | on other routes |"
)
NATIVE = ("none", "yes")
STAMP = ("none", "yes")
PROBES = ("none", "HTTP", "Python")
HARMLESS = ("no", "yes")
COMBINATIONS = list(itertools.product(NATIVE, STAMP, PROBES, HARMLESS))
# What each word of the table's last columns is, as the decision's action.
STEPS: dict[str, Action] = {
    "native key": Resend("native_key"),
    "probe": Probe(),
    "needs_review": Review(),
    "re-send": Resend("harmless"),
}
TTL = timedelta(hours=24)
# The probe's route in every row, a request of it, and a request of another route to the same upstream.
ROUTE = "POST /orders"
ON_ROUTE = ("POST", "/orders")
ELSEWHERE = ("POST", "/orders/ord_1/refund")


@dataclass(frozen=True)
class Row:
    """One row of the table: refused or accepted at load, and the recovery order on and off the probe's
    routes ("–" where there is no such order)."""

    at_load: str
    on_routes: str
    elsewhere: str


def documented() -> dict[tuple[str, ...], Row]:
    """The table's rows: (native key, stamp, probe, repeat_harmless) -> the row."""
    lines = PAGE.read_text().splitlines()
    assert HEADER in lines, f"{PAGE.name} has lost the table of configurations"
    rows: dict[tuple[str, ...], Row] = {}
    for line in lines[lines.index(HEADER) + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip().strip("*") for cell in line.strip().strip("|").split("|")]
        assert len(cells) == 7, line
        combination = tuple(cells[:4])
        assert combination not in rows, f"{line}: a second row for this combination"
        rows[combination] = Row(*cells[4:])
    return rows


def upstream(native: str, stamp: str, probe: str, harmless: str) -> dict[str, Any]:
    """An upstream's settings for one combination; the rest as a user would write it."""
    cfg: dict[str, Any] = {"base_url": "http://127.0.0.1:9", "repeat_harmless": harmless == "yes"}
    if native == "yes":
        cfg["native_key"] = {"header": "Idempotency-Key", "ttl": "24h"}
    if stamp == "yes":
        cfg["stamp"] = {"json_field": "client_reference"}
    if probe == "HTTP":
        cfg["probe"] = {"path": "/orders?client_reference={key}", "found": "items.0", "routes": [ROUTE]}
    if probe == "Python":
        cfg["probe"] = {"entry_point": "shop-orders", "routes": [ROUTE]}
    return cfg


def in_doubt(
    state: State,
    sent_ago: timedelta,
    policy: Policy,
    *,
    may_have_sent: bool = True,
    request: tuple[str, str] = ON_ROUTE,
) -> EffectRecord:
    """An effect first sent ``sent_ago`` under ``policy``, its lease run out, that may have reached the
    upstream."""
    sent = NOW - sent_ago
    method, path = request
    return replace(
        record(state),
        may_have_sent=may_have_sent,
        first_sent_at=sent,
        last_sent_at=sent,
        created_at=sent,
        method=method,
        path=path,
        key_carriers=policy.key_carriers,
        send_lease=policy.lease,
    )


def test_the_table_has_every_combination_once() -> None:
    """Each of the 24 combinations has its row, and there is no other."""
    assert sorted(documented()) == sorted(COMBINATIONS)


def _steps(order: str) -> list[str]:
    steps = order.split(" → ")
    assert all(step in STEPS for step in steps), order
    # Only the native key's trust ends with age, so only it may come before another step.
    assert len(steps) == 1 or (len(steps) == 2 and steps[0] == "native key"), order
    return steps


@pytest.mark.parametrize("combination", COMBINATIONS, ids="-".join)
@pytest.mark.parametrize("state", [State.IN_DOUBT, State.PENDING], ids=lambda s: s.value)
def test_each_combination_is_refused_or_recovers_as_documented(
    combination: tuple[str, str, str, str], state: State, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused combination stops loading in one line naming the probe; an accepted one sends what surely
    never left, and recovers a fresh effect in doubt by the row's first step and an old one by its last,
    on the probe's routes and off them."""
    monkeypatch.delenv("EFFECT_GATEWAY_CONFIG", raising=False)
    row = documented()[combination]
    cfg = {"shop": upstream(*combination)}
    if row.at_load == "refused":
        assert (row.on_routes, row.elsewhere) == ("–", "–")
        with pytest.raises(ConfigError) as caught:
            load_settings(None, upstreams=cfg)
        line = str(caught.value)
        assert line.startswith("bad setting upstreams.shop.probe: the probe looks for the effect by its key")
        assert "\n" not in line
        return
    assert row.at_load == "accepted"
    settings = load_settings(None, upstreams=cfg)
    policy = upstream_policy("shop", settings.upstreams["shop"], settings.lease_grace).decision
    orders = [(ELSEWHERE, row.elsewhere)]
    if combination[2] == "none":
        assert row.on_routes == "–"
    else:
        orders.append((ON_ROUTE, row.on_routes))
    for request, order in orders:
        steps = _steps(order)
        # the key well within its TTL, and past what any native key is trusted for
        fresh = in_doubt(state, policy.lease + timedelta(minutes=1), policy, request=request)
        old = in_doubt(state, TTL + timedelta(days=1), policy, request=request)
        assert decide(fresh, SAME, NOW, policy) == STEPS[steps[0]], request
        assert decide(old, SAME, NOW, policy) == STEPS[steps[-1]], request
        if state is State.IN_DOUBT:
            never_left = in_doubt(
                state, TTL + timedelta(days=1), policy, may_have_sent=False, request=request
            )
            assert decide(never_left, SAME, NOW, policy) == Resend("never_sent")


def _summary_steps(part: str) -> str:
    """check-config's steps of one part of an upstream's summary, in the table's words."""
    if part == "nothing: an effect in doubt goes to needs_review":
        return "needs_review"
    words = []
    for step in part.split(", then "):
        (word,) = [word for word in STEPS if step.startswith(word)]
        words.append(word)
    return " → ".join(words)


@pytest.mark.parametrize("combination", COMBINATIONS, ids="-".join)
def test_check_config_says_what_the_table_says(
    combination: tuple[str, str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """check-config's summary of each accepted combination lists the table's steps, on the probe's routes
    (naming them) and off them, so the page and the command cannot tell two stories."""
    monkeypatch.delenv("EFFECT_GATEWAY_CONFIG", raising=False)
    row = documented()[combination]
    if row.at_load == "refused":
        return  # checked above: such a configuration never loads, so check-config has nothing to say
    settings = load_settings(None, upstreams={"shop": upstream(*combination)})
    summary, _ = protection(upstream_policy("shop", settings.upstreams["shop"], settings.lease_grace))
    summary = summary.split("; key stamped in ")[0]
    if row.on_routes == "–":
        assert _summary_steps(summary) == row.elsewhere, summary
        return
    on_routes, elsewhere = summary.split("; on other routes: ")
    assert on_routes.startswith(f"on {ROUTE}: "), summary
    # check-config also says where a probe's "not found" past its horizon goes, which the table says
    # below it, in words: needs_review, never a re-send.
    expected = f"{row.on_routes} → needs_review"
    assert _summary_steps(on_routes.removeprefix(f"on {ROUTE}: ")) == expected, summary
    assert _summary_steps(elsewhere) == row.elsewhere, summary


def test_a_probe_for_the_native_key_alone_stops_trusting_not_found_when_the_key_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no stamp and no probe.horizon, a probe's "not found" counts only within the native key's TTL:
    past it the upstream may have forgotten the key it searches by, and the effect goes to review."""
    monkeypatch.delenv("EFFECT_GATEWAY_CONFIG", raising=False)
    cfg = upstream("yes", "none", "HTTP", "no")
    settings = load_settings(None, upstreams={"shop": cfg})
    policy = upstream_policy("shop", settings.upstreams["shop"], settings.lease_grace).decision
    # taken over to probe, past the key's TTL
    old = in_doubt(State.PENDING, TTL + timedelta(hours=1), policy)
    verdict = after_probe(old, NotFound(), NOW, policy, retaken_at=NOW)
    assert verdict != Send(), "sent again on a search by a key the upstream may have forgotten"
    assert isinstance(verdict, Settlement)
    assert verdict.state is State.NEEDS_REVIEW
    assert policy.probe_horizon == TTL
    # a horizon given says how long this upstream's search keeps the key, and is taken as given
    cfg["probe"] = {**cfg["probe"], "horizon": "30d"}
    settings = load_settings(None, upstreams={"shop": cfg})
    policy = upstream_policy("shop", settings.upstreams["shop"], settings.lease_grace).decision
    assert after_probe(old, NotFound(), NOW, policy, retaken_at=NOW) == Send()


def _kubernetes_config(tmp_path: Path) -> Path:
    docs = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "sidecar.yaml").read_text())
    (config_map,) = [doc for doc in docs if doc and doc["kind"] == "ConfigMap"]
    path = tmp_path / "gateway.toml"
    path.write_text(config_map["data"]["gateway.toml"])
    return path


SHIPPED = {
    "examples/gateway.toml": lambda _: ROOT / "examples" / "gateway.toml",
    "deploy/gateway.example.toml": lambda _: ROOT / "deploy" / "gateway.example.toml",
    "deploy/gateway.compose.toml": lambda _: ROOT / "deploy" / "gateway.compose.toml",
    "deploy/kubernetes/sidecar.yaml": _kubernetes_config,
    "the crash matrix's": lambda tmp: gateway_config(
        tmp, "postgresql://db/x", "http://a:1", "http://b:2", "http://c:3"
    ),
}


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_configurations_still_load(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every configuration the project ships or writes loads under these refusals, and has upstreams."""
    for variable in ("EFFECT_GATEWAY_CONFIG", "EFFECT_GATEWAY_DATABASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    settings = load_settings(SHIPPED[name](tmp_path), need_secrets=False)
    assert settings.upstreams
