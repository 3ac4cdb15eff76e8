"""One simulated world: gateways running the real EffectService, clients, operators, faults.

Everything is drawn from the run's :class:`~sim.choices.Choices`: how many gateways, clients and keys,
which upstream kinds with which timeouts, TTLs and horizons, when clients retry, what each upstream
does with each request, when a gateway crashes or pauses, when Postgres is out. The gateways are
:class:`gateway.service.EffectService` unmodified, each over its own connection to the one
:class:`~sim.store.SimDatabase`; the invariants (sim/invariants.py) watch every write the database
applies, every effect an upstream makes and every answer a client gets.

A run ends by healing: faults stop, dead gateways restart, leases run out, every key is retried until
it is answered, an operator settles what waits for one (truthfully, from the upstream's ledger), and
the final invariants are checked.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from gateway import operators, problems, replies
from gateway.audit_query import EffectFilter
from gateway.body import read_body
from gateway.endings import Ending
from gateway.errors import NoSuchEffect, NotAwaitingOperator, StoreRejected, StoreUnavailable
from gateway.inbound import Inbound
from gateway.policy import UpstreamPolicy, upstream_policy
from gateway.record import StoredResponse
from gateway.replies import Reply
from gateway.seams import Database
from gateway.service import EffectService
from gateway.settings import NativeKeySettings, ProbeSettings, StampSettings, UpstreamSettings
from gateway.states import State
from sim.choices import Choices, Stream
from sim.invariants import Checks, Violation
from sim.loop import OWNER, REQUEST, Owner, SimLoop
from sim.store import DATABASE, SimDatabase, SimStore, Trip
from sim.upstreams import NET, Call, Effect, Kind, SimClient, SimProber, SimUpstream

EPOCH = datetime(2026, 12, 2, tzinfo=UTC)
DAY = 86400.0
# Statements are quick on a healthy database; a slow one is the tail of a busy one.
DB_TRIP = (0.0002, 0.004)
# After this much virtual time clients stop starting requests (retention is days; a run spans a few).
LAST_REQUEST = 12 * DAY
# How long a probed upstream's search takes to list an effect, in seconds (and what its probe.lag says):
# leases here are 1.5 to 6 s, so a lag shorter than any, about one, and longer than any.
SEARCH_LAGS = (0.0, 0.5, 2.0, 8.0)
# Clients in a thousand that retry an open effect within seconds (see World.gap).
EAGER = 600
# How often each fault family strikes, per thousand opportunities; each run draws one level of each.
LEVELS: dict[str, tuple[int, ...]] = {
    "crash": (0, 8, 30, 90),
    "freeze": (0, 8, 30, 90),
    # A pause shorter than the send window (a GC, a busy core): the request still leaves, but late.
    "hiccup": (0, 30, 120, 300),
    "store-down": (0, 4, 15),
    "store-lost": (0, 8, 30),
    "store-refused": (0, 30, 150),
    "fate": (0, 100, 300, 600),
    "probe": (0, 150, 450),
    "operator": (0, 400, 1000),
    # A short pause (within the send window) just after a take-over: the moment a wave of retries at a
    # TTL's or horizon's edge makes a gateway busiest. Drawn last, from a stream of its own ("pauses"),
    # so that a schedule recorded before it existed replays as it did.
    "take-over-pause": (0, 300, 700),
    # A pause while a probe is out (a GC as its answer is read): the search looks before the gateway
    # reads the clock again, maybe while it cannot list the effect yet. Also its own stream ("pauses").
    "probe-pause": (0, 300, 700),
}


@contextmanager
def service_log_silenced() -> Iterator[None]:
    """The service's own log off for one run: the trace tells the story, and the log would repeat it.

    Only for the run: a process that imports the simulator (the test suite) keeps the gateway's log.
    """
    loggers = [logging.getLogger(name) for name in ("effect_gateway", "gateway")]
    before = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, before, strict=True):
            logger.disabled = disabled


Scope = tuple[str, str, str]


@dataclass
class Setup:
    """The shape of one run, drawn first (so that shrinking it to 0s makes the smallest world)."""

    gateways: int
    upstreams: list[tuple[Kind, UpstreamPolicy]]
    scopes: list[Scope]
    clients: list[list[Scope]]
    levels: dict[str, int]
    retention: timedelta
    purge_every: float
    replay_cache: int
    clock_offset: float

    def describe(self) -> list[str]:
        lines = [f"{self.gateways} gateway(s), {len(self.clients)} client(s), retention {self.retention}"]
        for kind, p in self.upstreams:
            d = p.decision
            spoken = " over MCP" if p.protocol == "mcp" else ""
            lines.append(
                f"upstream {p.name}: {kind.value}{spoken}; timeout {p.timeout.total_seconds():g}s, lease "
                f"{d.lease.total_seconds():g}s"
                + (f", key TTL {d.native_key_ttl.total_seconds():g}s" if d.native_key_ttl else "")
                + (f", probe horizon {d.probe_horizon.total_seconds():g}s" if d.probe_horizon else "")
                + (", probe with no horizon" if d.has_probe and not d.probe_horizon else "")
                + (f", search lag {d.probe_lag.total_seconds():g}s" if d.has_probe and d.probe_lag else "")
            )
        for i, jobs in enumerate(self.clients, 1):
            lines.append(f"client c{i}: " + ", ".join(f"{t}/{u}/{k}" for t, u, k in jobs))
        faults = [f"{name} {level}/1000" for name, level in self.levels.items() if level]
        lines.append("faults: " + (", ".join(faults) if faults else "none"))
        return lines


def draw_setup(everything: Choices) -> Setup:
    choices = everything["setup"]
    gateways = 1 + choices.below(3)
    upstreams: list[tuple[Kind, UpstreamPolicy]] = []
    for name in ("shop", "mail")[: 1 + choices.below(2)]:
        kind = choices.pick(list(Kind))
        timeout = timedelta(seconds=choices.pick([1, 2, 4]))
        grace = timedelta(seconds=choices.pick([0.5, 1, 2]))
        memory = timedelta(seconds=choices.pick([60, 30, 120]))
        probe_horizon = choices.pick([memory, None])
        # How long its search takes to list an effect: none, under a lease, about one, several. Drawn
        # from a stream of its own, so that a schedule recorded before searches lagged replays as it did.
        search_lag = timedelta(seconds=everything["lag"].pick(SEARCH_LAGS))
        # An MCP server's tool instead of an HTTP API, a third of the time: drawn from a stream of its own,
        # so that a schedule recorded before there were MCP upstreams replays as it did (all HTTP).
        mcp = everything["protocol"].chance(333)
        probed = kind in (Kind.PROBED, Kind.STRIPE)
        probe = ProbeSettings(
            path="/orders/search?ref={key}",
            found="items.0",
            status=201,
            horizon=probe_horizon,
            lag=search_lag,
            routes=["POST /orders"],
        )
        if mcp:
            probe = ProbeSettings(
                path="/mcp",
                tool="find_orders",
                arguments={"client_reference": "{key}"},
                found="structuredContent.orders.0",
                horizon=probe_horizon,
                lag=search_lag,
                tools=["place_order"],
            )
        stamp = "params.arguments.client_reference" if mcp else "client_reference"
        cfg = UpstreamSettings(
            base_url=f"http://{name}.sim",
            timeout=timeout,
            native_key=NativeKeySettings(ttl=memory) if kind in (Kind.NATIVE, Kind.STRIPE) else None,
            stamp=StampSettings(json_field=stamp) if probed else None,
            probe=probe if probed else None,
            repeat_harmless=kind is Kind.HARMLESS,
            protocol="mcp" if mcp else "http",
        )
        upstreams.append((kind, upstream_policy(name, cfg, grace)))
    tenants = ["t1", "t2"][: 1 + choices.below(2)]
    scopes = [
        (tenant, policy.name, f"k{i}")
        for _, policy in upstreams
        for tenant in tenants
        for i in range(1, 2 + choices.below(2))
    ]
    clients = [
        [choices.pick(scopes) for _ in range(1 + choices.below(2))] for _ in range(1 + choices.below(4))
    ]
    levels = {name: everything["levels"].pick(list(options)) for name, options in LEVELS.items()}
    return Setup(
        gateways=gateways,
        upstreams=upstreams,
        scopes=scopes,
        clients=clients,
        levels=levels,
        retention=timedelta(days=choices.pick([1, 2])),
        purge_every=choices.pick([3600.0, 6 * 3600.0]),
        replay_cache=choices.pick([1 << 20, 0]),
        clock_offset=choices.between(0, DAY, 96),
    )


class Gateway:
    """One gateway process: an EffectService per incarnation, over its own store connection."""

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.name = name
        self.incarnation = 0
        self.owner: Owner = Owner(f"{name}#0", dead=True)
        self.context = contextvars.Context()
        self.service: EffectService | None = None
        self.store = SimStore(world.db, world, who=name)
        self.client = SimClient(world, world.upstreams, name)
        self.prober = SimProber(world, world.upstreams, name)
        # Client requests in flight here: a crash breaks their connections.
        self.waiting: dict[int, asyncio.Future[Reply | BaseException]] = {}

    @property
    def up(self) -> bool:
        return not self.owner.dead

    def start(self) -> None:
        self.incarnation += 1
        self.owner = Owner(f"{self.name}#{self.incarnation}")
        self.context = contextvars.Context()
        self.context.run(OWNER.set, self.owner)
        # A new process: the batches of claims and settles that the last one queued died with it.
        self.store = SimStore(self.world.db, self.world, who=self.name)
        self.service = EffectService(
            self.store,
            self.client,
            self.prober,
            self.world.db.key_secret,
            retention=self.world.setup.retention,
            replay_cache_bytes=self.world.setup.replay_cache,
        )
        self.world.note(self.owner.name, "starts")

    def crash(self) -> None:
        """SIGKILL: nothing of this incarnation runs again; its store writes stay."""
        if not self.up:
            return
        self.owner.dead = True
        self.world.note(self.owner.name, "CRASHES")
        loop = asyncio.get_running_loop()
        for request, waiting in list(self.waiting.items()):
            broken = ConnectionResetError(f"gateway {self.owner.name} died serving r{request}")
            loop.call_later(self.world.net.between(*NET), _resolve, waiting, broken, context=DATABASE)
        self.waiting.clear()
        if not self.world.choices.quiet:
            lease = self.world.longest_lease
            chaos = self.world.chaos
            later = chaos.pick([chaos.between(0.01, 3 * lease), 600.0])
            loop.call_later(later, self.restart, context=DATABASE)

    def restart(self) -> None:
        if not self.up:
            self.start()

    def freeze(self, seconds: float) -> None:
        now = asyncio.get_running_loop().time()
        if self.up and self.owner.frozen_until < now + seconds:
            self.owner.frozen_until = now + seconds
            self.world.note(self.owner.name, f"PAUSES for {seconds:.3f}s")

    def serve(self, inbound: Inbound, request: int) -> asyncio.Future[Reply | BaseException]:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Reply | BaseException] = loop.create_future()
        assert self.service is not None
        context = self.context.copy()
        context.run(REQUEST.set, request)
        task = loop.create_task(self.service.handle(inbound), context=context)
        self.waiting[request] = answer

        def done(task: asyncio.Task[Reply | Ending]) -> None:
            self.waiting.pop(request, None)
            # What the agent gets: the reply, or the problem the app would answer with (replies.problem).
            error = task.exception()
            outcome: Reply | BaseException = error if error is not None else _answered(task.result())
            loop.call_later(self.world.net.between(*NET), _resolve, answer, outcome, context=DATABASE)

        task.add_done_callback(done, context=DATABASE)
        return answer


def _answered(result: Reply | Ending) -> Reply | BaseException:
    return result if isinstance(result, Reply) else replies.problem(result)


def _resolve(answer: asyncio.Future[Reply | BaseException], outcome: Reply | BaseException) -> None:
    if not answer.done():
        answer.set_result(outcome)


@dataclass
class Tally:
    requests: int = 0
    effects: int = 0
    crashes: int = 0
    calls: int = 0  # MCP tool calls made: each request's JSON-RPC id


class World:
    """Implements the upstreams' Stage and the store's Weather; runs the clients, faults and checks."""

    def __init__(self, choices: Choices, loop: SimLoop) -> None:
        self.choices = choices
        self.net = choices["net"]
        self.chaos = choices["faults"]
        self.loop = loop
        self.trace: list[tuple[float, str, str]] = []
        self.setup = draw_setup(choices)
        self.db = SimDatabase(self.db_clock)
        self.upstreams: dict[str, SimUpstream] = {}
        for kind, policy in self.setup.upstreams:
            horizon = policy.decision.probe_horizon
            self.upstreams[policy.name] = SimUpstream(
                policy.name,
                kind,
                policy,
                self,
                search_retention=horizon.total_seconds() if horizon is not None else None,
                search_lag=policy.decision.probe_lag.total_seconds(),
            )
        self.longest_lease = max(p.lease.total_seconds() for _, p in self.setup.upstreams)
        windows = [p.lease.total_seconds() - p.timeout.total_seconds() for _, p in self.setup.upstreams]
        self.shortest_window, self.longest_window = min(windows), max(windows)
        self.gateways = [Gateway(self, f"g{i}") for i in range(1, self.setup.gateways + 1)]
        # Typed as the gateway's whole database (seams.Database): mypy holds the simulated store to it.
        self.operator_store: Database = SimStore(self.db, self, who="operator")
        self.checks = Checks(self)
        self.db.observers.append(self.checks.write)
        loop.after_step = self.checks.step
        self.outage_until = 0.0
        self.requested: dict[Scope, float] = {}  # first time any client asked for the scope
        self.tally = Tally()
        self.violation: Violation | None = None
        self.over: asyncio.Future[None] | None = None

    # --- time, trace, violations ----------------------------------------------------------------------

    @property
    def epoch(self) -> datetime:
        """The database's time when the loop's clock reads 0."""
        return EPOCH + timedelta(seconds=self.setup.clock_offset)

    def db_clock(self) -> datetime:
        return self.epoch + timedelta(seconds=self.loop.time())

    def now(self) -> float:
        """Return the simulated time, in seconds since the run began."""
        return self.loop.time()

    def note(self, who: str, text: str) -> None:
        self.trace.append((self.loop.time(), who, text))

    def violate(self, violation: Violation) -> None:
        if self.violation is None:
            self.violation = violation
            self.note("CHECK", f"VIOLATION {violation.invariant}: {violation.detail}")
            if self.over is not None and not self.over.done():
                self.over.set_result(None)

    # --- Stage (the upstreams) and Weather (the store) ------------------------------------------------

    def faulty(self, what: str) -> bool:
        if self.choices.quiet:
            return False
        return self.chaos.chance(self.setup.levels[what.partition(":")[0]])

    def arrived(self, upstream: SimUpstream, call: Call) -> None:
        self.checks.arrived(upstream, call)

    def landed(self, upstream: SimUpstream, effect: Effect, call: Call) -> None:
        self.tally.effects += 1
        self.checks.landed(upstream, effect, call)

    def hazard(self, who: str, within: float) -> None:
        """At a point where a gateway does I/O: it may crash within ``within`` seconds, or pause now."""
        gateway = self._gateway(who)
        if gateway is None or not gateway.up:
            return
        if self.faulty("crash"):
            owner = gateway.owner
            self.loop.call_later(self.chaos.between(0, within), self._crash, gateway, owner, context=DATABASE)
        elif self.faulty("freeze"):
            gateway.freeze(self.chaos.between(0, 3 * self.longest_lease))
        elif self.faulty("hiccup"):
            gateway.freeze(self.chaos.between(0, 1.25 * self.shortest_window))

    def _after_take_over(self, who: str) -> None:
        """A take-over's gateway may pause as its answer comes back, yet within its send window."""
        gateway = self._gateway(who)
        pauses = self.choices["pauses"]
        if gateway is not None and gateway.up and pauses.chance(self.setup.levels["take-over-pause"]):
            gateway.freeze(pauses.between(0, self.longest_window))

    def probing(self, who: str, upstream: SimUpstream) -> None:
        """A gateway's probe is about to leave: it may pause until after the search has looked."""
        gateway = self._gateway(who)
        pauses = self.choices["probe-pauses"]
        if self.choices.quiet or gateway is None or not gateway.up:
            return
        if pauses.chance(self.setup.levels["probe-pause"]):
            gateway.freeze(pauses.between(0, upstream.search_lag + self.longest_lease))

    def _crash(self, gateway: Gateway, owner: Owner) -> None:
        if gateway.owner is owner and not self.choices.quiet:
            self.tally.crashes += 1
            gateway.crash()

    def _gateway(self, who: str) -> Gateway | None:
        name = who.partition("#")[0].partition("/")[0]
        return next((g for g in self.gateways if g.name == name), None)

    def trip(self, statement: str, who: str, refusable: Sequence[tuple[int, int]]) -> Trip:
        there, back = self.net.between(*DB_TRIP), self.net.between(*DB_TRIP)
        if self.choices.quiet:
            return Trip(there, back)
        self.hazard(who, there + back)
        if statement == "reclaim":
            self._after_take_over(who)
        now = self.loop.time()
        if now < self.outage_until or self.faulty("store-down"):
            if now >= self.outage_until:
                self.outage_until = now + self.chaos.between(0.05, 3 * self.longest_lease)
                self.note("db", f"OUTAGE until {self.outage_until - now:.3f}s from now")
            return Trip(there, back, "down")
        if self.faulty("store-lost"):
            self.note("db", f"{who}: the answer to {statement} will be lost")
            return Trip(there, back, "lost")
        if refusable and self.faulty("store-refused"):
            if len(refusable) == 1:
                self.checks.refused.add(refusable[0])
                self.note("db", f"{who}: Postgres refuses {statement} of effect {refusable[0][0]}")
            else:
                # The store writes the batch again a row at a time; each of those may be refused.
                self.note("db", f"{who}: Postgres refuses {statement} of effects {[r[0] for r in refusable]}")
            return Trip(there, back, "refused")
        return Trip(there, back)

    # --- clients --------------------------------------------------------------------------------------

    def inbound(self, scope: Scope, wait: float) -> Inbound:
        tenant, upstream, key = scope
        fields = {"item": key, "ref": f"{tenant}/{key}"}
        policy = self.upstreams[upstream].policy
        tool = None
        doc: dict[str, Any] = fields
        path = "/orders"
        if policy.protocol == "mcp":
            # A tools/call, with an id of the request's own (a retry is another request).
            self.tally.calls += 1
            params = {"name": "place_order", "arguments": fields}
            doc = {"jsonrpc": "2.0", "id": self.tally.calls, "method": "tools/call", "params": params}
            tool, path = "place_order", "/mcp"
        raw = json.dumps(doc, separators=(",", ":")).encode()
        # Parsed as the gateway's edge parses it (strictly, and for a JSON stamp's path).
        body = read_body(raw, "application/json", policy.json_stamp_path)
        return Inbound(
            tenant=tenant,
            upstream=policy,
            method="POST",
            path=path,
            query="",
            headers={"Content-Type": "application/json"},
            body=body,
            key=key,
            wait=wait,
            tool=tool,
        )

    async def request(
        self, client: str, scope: Scope, gateway: Gateway, wait: float
    ) -> Reply | BaseException:
        """One request of a client through a gateway, and the checks of its answer."""
        self.tally.requests += 1
        number = self.tally.requests
        started = self.loop.time()
        self.requested.setdefault(scope, self.loop.time())
        self.note(
            client,
            f"r{number} -> {gateway.name} {scope[0]}/{scope[1]}/{scope[2]}"
            + (f" wait={wait:g}" if wait else ""),
        )
        await asyncio.sleep(self.net.between(*NET))
        result: Reply | BaseException
        if not gateway.up:
            result = ConnectionRefusedError(f"{gateway.name} is down")
        else:
            result = await gateway.serve(self.inbound(scope, wait), number)
        self.note(client, f"r{number} <- {_shown(result)}")
        self.checks.reply(scope, number, started, number in gateway.client.sent, result)
        return result

    def gap(self, mind: Stream, aim: Stream, scope: Scope, later: bool, eager: Stream | None = None) -> float:
        """How long a client waits before asking again: soon, about a lease, at an edge, or days.

        An eager client (``eager``, its own stream) retries what is still open within seconds half the
        time, while a probe's search may not list what the last attempt did yet.
        """
        lease = self.longest_lease
        upstream = self.upstreams[scope[1]].policy.decision
        # Where the probe is what recovers an effect in doubt (with a native key, it is the key until
        # its TTL, whose edges the aim below covers).
        lag = upstream.probe_lag.total_seconds() if upstream.native_key_ttl is None else 0.0
        if eager is not None and lag and not later and eager.chance(500):
            return eager.between(0, lag + lease)
        edges = [t.total_seconds() for t in (upstream.native_key_ttl, upstream.probe_horizon) if t]
        way = mind.below(4) if not later else 2 + mind.below(2)
        if way == 0:
            return mind.between(0, 0.2)
        if way == 1:
            return mind.between(0, 2 * lease)
        if way == 2 and edges:
            # Aim at an edge of trust (a TTL or a horizon less the margin), measured from the first request.
            edge = mind.pick(edges) - mind.pick([lease, 0.0])
            offset = mind.between(-lease, lease)
            if aim.chance(750):
                # Just short of the edge, by up to one send window (a scheduler retrying at the TTL it
                # was told): the take-over still trusts what the edge bounds, and a short pause after
                # it lands the request past it. A stream of its own, as for "take-over-pause".
                assert upstream.send_window is not None
                offset = -aim.between(0, upstream.send_window.total_seconds())
            target = self.requested.get(scope, self.loop.time()) + edge + offset
            return max(0.0, target - self.loop.time())
        retention = self.setup.retention.total_seconds()
        return mind.between(retention, retention + 2 * DAY)

    async def client(self, name: str, jobs: list[Scope]) -> None:
        mind = self.choices[name]
        aim = self.choices[f"{name}/aim"]
        # One client in three retries eagerly; drawn from a stream of its own (see "take-over-pause").
        haste = self.choices[f"{name}/eager"]
        eager = haste if haste.chance(EAGER) else None
        await asyncio.sleep(mind.between(0, 3))
        for scope in jobs:
            reruns = mind.below(3)
            for _ in range(2 + mind.below(6)):
                if self.violation is not None or self.loop.time() > LAST_REQUEST:
                    return
                gateway = mind.pick(self.gateways)
                wait = mind.pick([0.0, 1.0, 3 * self.longest_lease])
                result = await self.request(name, scope, gateway, wait)
                verdict = settled(result)
                if verdict == "done" and reruns == 0:
                    break
                if verdict == "done":
                    reruns -= 1
                await asyncio.sleep(self.gap(mind, aim, scope, later=verdict != "retry", eager=eager))

    # --- operators and the retention --------------------------------------------------------------------

    def truth(self, scope: Scope) -> StoredResponse | None:
        """What the upstream's own ledger says of the effect: its answer if it happened."""
        effects = self.upstreams[scope[1]].effects(scope)
        return effects[0].answer if effects else None

    def page(self, effect_id: int, state: State, lease_ends: float) -> None:
        """A record went where an operator may act on it: now and then one comes to look, soon or later.

        Called by the checks as the database applies the write; the visit is aimed at the moments
        where a verdict could race with the gateways: right away, around the lease's end, or later.
        """
        if not self.faulty("operator"):
            return
        lease = self.longest_lease
        now = self.loop.time()
        mind = self.choices["operator"]
        when = mind.pick(
            [mind.between(0, 2 * lease), lease_ends - now + mind.between(-lease, lease), mind.between(0, 600)]
        )
        think = mind.pick([0.0, mind.between(0, 2 * lease)])
        self.loop.call_later(max(0.0, when), self._visit, effect_id, think, context=DATABASE)

    def _visit(self, effect_id: int, think: float) -> None:
        if not self.choices.quiet and self.violation is None:
            self.loop.create_task(self.resolve(effect_id, think), context=contextvars.Context())

    async def resolve(self, effect_id: int, think: float) -> None:
        try:
            looked = await self.operator_store.get(effect_id)
        except StoreUnavailable:
            return
        if looked is None:
            return
        scope = (looked.tenant, looked.upstream, looked.key)
        # As GET /_gateway/effects/{id} ("resolvable") and the audit page show it: a verdict is given
        # only on a record that waits for one, its lease over (a call under way may still act).
        if not operators.resolvable(looked):
            self.note("operator", f"looks at {scope[0]}/{scope[2]} ({looked.state}): nothing to judge yet")
            return
        answer = self.truth(scope)
        self.note(
            "operator",
            f"looks at {scope[0]}/{scope[2]} ({looked.state}): {'happened' if answer else 'did not happen'}",
        )
        await asyncio.sleep(think)
        try:
            await operators.resolve(
                self.operator_store,
                effect_id,
                attempt=looked.attempt,  # the verdict holds for the record the operator judged
                happened=answer is not None,
                response=answer,
                by="operator",
            )
            self.note("operator", f"resolved {scope[0]}/{scope[2]}")
        except (NotAwaitingOperator, NoSuchEffect, StoreUnavailable, StoreRejected) as exc:
            self.note("operator", f"refused: {exc}")

    async def maintainer(self) -> None:
        store = SimStore(self.db, self, who="purge")
        while self.violation is None:
            await asyncio.sleep(self.setup.purge_every)
            try:
                dropped = await store.maintain(self.setup.retention)
            except StoreUnavailable:
                continue
            for day in dropped:
                self.note("purge", f"drops the bodies of {day.lower:%Y-%m-%d} ({day.rows})")

    # --- the run ------------------------------------------------------------------------------------------

    async def main(self) -> None:
        self.over = self.loop.create_future()
        for gateway in self.gateways:
            gateway.start()
        world = contextvars.Context()
        clients = [
            self.loop.create_task(self.client(f"c{i}", jobs), context=world.copy())
            for i, jobs in enumerate(self.setup.clients, 1)
        ]
        background = [self.loop.create_task(self.maintainer(), context=world.copy())]
        everyone: asyncio.Future[Any] = asyncio.gather(*clients)
        await asyncio.wait([everyone, self.over], return_when=asyncio.FIRST_COMPLETED)
        if self.violation is None:
            await self.heal()
        for task in background:
            task.cancel()
        if self.violation is None:
            self.checks.final()

    async def heal(self) -> None:
        """Faults stop; every key is retried until answered; an operator settles the rest; retried again."""
        self.choices.quiet = True
        self.outage_until = 0.0
        self.note("world", "HEALING: faults stop, dead gateways restart")
        for gateway in self.gateways:
            gateway.owner.frozen_until = 0.0
            if not gateway.up:
                gateway.start()
        await asyncio.sleep(self.longest_lease + 1)
        self.checks.at_rest()
        for scope in list(self.requested):
            await self.answered(scope)
        for record in await self.operator_store.find(EffectFilter(state=State.NEEDS_REVIEW, limit=1000)):
            await self.resolve(record.id, think=0)
        for scope in list(self.requested):
            await self.answered(scope)
        await asyncio.sleep(self.longest_lease + 1)

    async def answered(self, scope: Scope) -> None:
        for _ in range(6):
            if self.violation is not None:
                return
            result = await self.request("healer", scope, self.gateways[0], 3 * self.longest_lease)
            if settled(result) == "done":
                return
            # As an agent would: no sooner than Retry-After (a probe waiting out its search's lag).
            told = float(result.headers.get("Retry-After", 0)) if isinstance(result, problems.Problem) else 0
            await asyncio.sleep(max(self.longest_lease, told))


def settled(result: Reply | BaseException) -> str:
    """What a client makes of an answer: done, retry soon, or come back later."""
    match result:
        case Reply(response=response):
            return "retry" if response.status in (429, 409) or response.status >= 500 else "done"
        case problems.ResponsePurged() | problems.KeyReused():
            return "done"
        case problems.OutcomeUnknown():
            return "later"
    return "retry"


def _shown(result: Reply | BaseException) -> str:
    match result:
        case Reply(response=response, replayed=replayed):
            return f"{response.status}" + (" (replayed)" if replayed else "") + f" {response.body[:40]!r}"
        case problems.Problem():
            return f"{result.status} {result.type}"
    return f"{type(result).__name__}: {result}"
