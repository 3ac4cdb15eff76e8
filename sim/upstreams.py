"""Simulated upstreams, and the simulated sender and prober that reach them (gateway.seams' Sender and
EffectProbe).

An upstream is one of the kinds an operator configures: a native key that it forgets after a TTL,
a stamp that its search (the probe) finds for a while, from a lag after the effect on (an index that
refreshes), both (like Stripe), neither, or harmless duplicates. Every effect it makes lands in its
:attr:`SimUpstream.ledger`: the truth that the invariants and the operators read.
:class:`SimClient` and :class:`SimProber` have the methods of
:class:`gateway.upstream.UpstreamClient` (``send``) and :class:`gateway.probes.Prober` (``probe``)
that the driver calls; what the upstream does with a request is drawn
from the run's choices.

The one thing an upstream promises (the lease's premise, DESIGN.md): it finishes or abandons a
request within the gateway's timeout of receiving it. Everything else may fail.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from gateway import mcp
from gateway.errors import ProbeFailed
from gateway.outcome import Answered, NoAnswer, NotSent, Outcome
from gateway.policy import UpstreamPolicy
from gateway.record import StoredResponse
from gateway.replies import describe
from gateway.upstream import Outbound
from sim.choices import Stream
from sim.loop import OWNER, REQUEST
from sim.store import DATABASE

JSON = (("Content-Type", "application/json"),)
# How long a message takes on the simulated network, one way: from a local hop to a slow link.
NET = (0.0002, 0.02)


class Kind(StrEnum):
    NATIVE = "native key"
    PROBED = "stamp + probe"
    STRIPE = "native key + probe"
    NEITHER = "neither"
    HARMLESS = "harmless"


class Fate(StrEnum):
    """What one request meets. Each is something an HTTP upstream really does."""

    OK = "answers"
    REFUSED = "refuses the connection (nothing sent)"
    RESET_BEFORE = "resets the connection before acting"
    THROTTLED = "answers 429 without acting"
    BUSY = "answers 503 without acting"
    ABANDONED = "drops the request without acting (the gateway times out)"
    FAILED_AFTER = "acts, then answers 5xx"
    LOST = "acts, then its answer is lost (the gateway times out)"
    RESET_AFTER = "acts, then resets the connection"
    STALLED = "acts late, near the gateway's timeout, and never answers"


FAULTS = [f for f in Fate if f is not Fate.OK]


class ProbeFate(StrEnum):
    OK = "answers"
    FAILS = "fails (5xx)"
    SLOW = "does not answer within the timeout"


Scope = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class Effect:
    n: int
    scope: Scope
    derived_key: str | None
    at: float
    answer: StoredResponse


@dataclass(eq=False)
class Call:
    """One request at the upstream, from its arrival until it is over there."""

    scope: Scope
    who: str
    fate: Fate
    sent: float
    timeout: float
    request: int = 0  # the simulator's number of the client request being served
    over: bool = False


class Stage(Protocol):
    """What an upstream needs from the world around it."""

    net: Stream  # delays
    chaos: Stream  # what goes wrong

    def note(self, who: str, text: str) -> None: ...
    def faulty(self, what: str) -> bool: ...
    def hazard(self, who: str, within: float) -> None: ...
    def probing(self, who: str, upstream: SimUpstream) -> None: ...
    def arrived(self, upstream: SimUpstream, call: Call) -> None: ...
    def landed(self, upstream: SimUpstream, effect: Effect, call: Call) -> None: ...


@dataclass(eq=False)
class SimUpstream:
    name: str
    kind: Kind
    policy: UpstreamPolicy
    stage: Stage
    # How long the upstream's search sees an effect (None: for ever): the horizon it really has.
    search_retention: float | None = None
    # How long after an effect its search starts listing it (an index that refreshes): the real lag.
    search_lag: float = 0.0
    ledger: list[Effect] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    # native key -> (the effect made under it, or None while its first request runs; forgotten at)
    remembered: dict[str, tuple[Effect | None, float]] = field(default_factory=dict)

    @property
    def ttl(self) -> float | None:
        return self.policy.native_ttl.total_seconds() if self.policy.native_ttl else None

    def effects(self, scope: Scope) -> list[Effect]:
        return [e for e in self.ledger if e.scope == scope]

    def in_flight(self, scope: Scope) -> list[Call]:
        return [c for c in self.calls if c.scope == scope and not c.over]

    def _answer(self, n: int, scope: Scope) -> StoredResponse:
        body = {"id": f"{self.name}-{n}", "ref": f"{scope[0]}/{scope[2]}", "upstream": self.name}
        text = json.dumps(body, separators=(",", ":"))
        if self.policy.protocol == "mcp":
            # A tool's result, as the gateway stores it (gateway.mcp): what its search finds, too.
            result = json.dumps({"content": [{"type": "text", "text": text}], "isError": False})
            return StoredResponse(200, mcp.STORED_HEADERS, f'{{"result":{result}}}'.encode())
        return StoredResponse(201, JSON, text.encode())

    def _fields(self, outbound: Outbound) -> dict[str, Any]:
        """The request's own fields: its JSON body's, or an MCP tool call's arguments."""
        doc: dict[str, Any] = json.loads(outbound.body)
        return doc["params"]["arguments"] if self.policy.protocol == "mcp" else doc

    def _as_sent(self, outbound: Outbound, outcome: Outcome) -> Outcome:
        """An HTTP answer as an MCP server would give it, read by the gateway's own reader (gateway.mcp):
        a result under the call's id for a 2xx, the status alone for any other."""
        if self.policy.protocol != "mcp" or not isinstance(outcome, Answered) or outbound.answer_to is None:
            return outcome
        message = b""
        if outcome.status < 300:
            message = b'{"jsonrpc":"2.0","id":' + outbound.answer_to.encode() + b"," + outcome.body[1:]
        read = mcp.answer_of(outcome.status, "application/json", message, outbound.answer_to)
        if read is None:
            return NoAnswer("the MCP server's answer holds no response to the call")
        return Answered(outcome.status, mcp.STORED_HEADERS, read.stored, ran=read.ran)

    def scope_of(self, outbound: Outbound) -> Scope:
        """The simulator's label of the effect (not the gateway's key: a request carries it in its body)."""
        ref = self._fields(outbound)["ref"]
        tenant, _, key = ref.partition("/")
        return (tenant, self.name, key)

    def _native_key(self, outbound: Outbound) -> str | None:
        header = self.policy.native_header
        return outbound.headers.get(header) if header else None

    def _stamped_key(self, outbound: Outbound) -> str | None:
        if self.policy.stamp is None:
            return None
        doc: Any = json.loads(outbound.body)
        for name in self.policy.stamp[1].split("."):
            doc = doc.get(name) if isinstance(doc, dict) else None
        return doc if isinstance(doc, str) else None

    # --- a request, from arrival to its end (run in the world's context: no gateway stops it) ------

    def receive(self, call: Call, outbound: Outbound, reply: asyncio.Future[Outcome]) -> None:
        loop = asyncio.get_running_loop()
        net, chaos = self.stage.net, self.stage.chaos
        now = loop.time()
        self.calls.append(call)
        self.stage.arrived(self, call)
        # The latest the upstream may still act: the gateway's timeout from when the request left.
        deadline = call.sent + call.timeout
        back = net.between(*NET)

        def answer(at: float, outcome: Outcome) -> None:
            outcome = self._as_sent(outbound, outcome)

            def deliver() -> None:
                call.over = True
                if not reply.done():
                    reply.set_result(outcome)

            loop.call_at(min(at, deadline), deliver, context=DATABASE)

        # Before the API's own logic: the connection, throttling, shedding load.
        fate = call.fate
        if fate is Fate.RESET_BEFORE:
            self.stage.note(self.name, f"{call.who}: connection reset before acting")
            answer(now, NoAnswer("the connection broke after sending: ServerDisconnectedError"))
            return
        if fate in (Fate.THROTTLED, Fate.BUSY):
            status = 429 if fate is Fate.THROTTLED else 503
            self.stage.note(self.name, f"{call.who}: answers {status} without acting")
            answer(now + back, Answered(status, JSON, b'{"error":"try later"}'))
            return
        if fate is Fate.ABANDONED:
            self.stage.note(self.name, f"{call.who}: drops the request")
            loop.call_at(net.between(now, deadline), _over, call, context=DATABASE)
            return
        # The API's idempotency keys: a key in use by a running request is refused, a known one replayed.
        key = self._native_key(outbound)
        memory = self.remembered.get(key) if key else None
        if key and memory is not None and memory[1] <= now:
            del self.remembered[key]
            self.stage.note(self.name, f"forgets key {key[:14]}")
            memory = None
        if memory is not None and memory[0] is None:
            self.stage.note(self.name, f"{call.who}: key in use by a request still running: 409")
            answer(now + back, Answered(409, JSON, b'{"error":"idempotency key in use"}'))
            return
        if key and memory is None and self.ttl is not None:
            self.remembered[key] = (None, now + self.ttl)
        if fate is Fate.STALLED:
            acts = net.between(now, deadline)
        else:
            acts = min(now + net.between(0.001, 0.3 * call.timeout), deadline)
        known = memory[0] if memory is not None else None

        def act() -> None:
            at = loop.time()
            if known is not None:
                effect = known
                self.stage.note(self.name, f"{call.who}: key known, replays effect #{effect.n}")
            else:
                n = len(self.ledger) + 1
                effect = Effect(
                    n, call.scope, key or self._stamped_key(outbound), at, self._answer(n, call.scope)
                )
                self.ledger.append(effect)
                if key and key in self.remembered:
                    self.remembered[key] = (effect, self.remembered[key][1])
                self.stage.note(self.name, f"{call.who}: EFFECT #{n} for {call.scope[0]}/{call.scope[2]}")
                self.stage.landed(self, effect, call)
            match fate:
                case Fate.OK:
                    answer(
                        at + back, Answered(effect.answer.status, effect.answer.headers, effect.answer.body)
                    )
                case Fate.FAILED_AFTER:
                    answer(
                        at + back, Answered(chaos.pick([500, 502, 503, 504]), JSON, b'{"error":"internal"}')
                    )
                case Fate.RESET_AFTER:
                    answer(at + back, NoAnswer("the connection broke after sending: ServerDisconnectedError"))
                case _:  # LOST, STALLED: no answer; the gateway times out
                    call.over = True

        loop.call_at(acts, act, context=DATABASE)

    # --- the search a probe asks ------------------------------------------------------------------

    def search(self, derived_key: str, now: float) -> StoredResponse | None:
        """The oldest effect stamped with ``derived_key`` that the search already lists and still sees."""
        for effect in self.ledger:
            if effect.derived_key != derived_key or now - effect.at < self.search_lag:
                continue
            if self.search_retention is not None and now - effect.at > self.search_retention:
                continue
            return effect.answer
        return None


def _over(call: Call) -> None:
    call.over = True


class SimClient:
    """gateway.upstream.UpstreamClient's ``send``, to the simulated upstreams."""

    def __init__(self, stage: Stage, upstreams: dict[str, SimUpstream], who: str) -> None:
        self._stage = stage
        self._upstreams = upstreams
        self._who = who
        # Requests that may have reached an upstream, by the simulator's request id (see world.REQUEST).
        self.sent: set[int] = set()

    async def close(self) -> None:
        pass

    async def send(self, request: Outbound, timeout: float, leave_within: float | None = None) -> Outcome:
        # The simulated network has no pool to wait for: a request leaves at once, well within the window.
        loop = asyncio.get_running_loop()
        upstream = self._upstreams[(request.url.host or "").partition(".")[0]]
        owner = OWNER.get()
        who = f"{owner.name if owner else self._who}/r{REQUEST.get()}"
        self._stage.hazard(who, timeout)
        fate = self._stage.chaos.pick(FAULTS) if self._stage.faulty(f"fate:{upstream.name}") else Fate.OK
        if fate is Fate.REFUSED:
            self._stage.note(who, f"-> {upstream.name}: connection refused, nothing sent")
            await asyncio.sleep(self._stage.net.between(*NET))
            return NotSent("could not send: ClientConnectorError: connection refused")
        self.sent.add(REQUEST.get())
        call = Call(upstream.scope_of(request), who, fate, loop.time(), timeout, REQUEST.get())
        self._stage.note(who, f"-> {upstream.name} {request.method} {request.url.path} ({fate.value})")
        reply: asyncio.Future[Outcome] = loop.create_future()
        loop.call_later(
            self._stage.net.between(*NET), upstream.receive, call, request, reply, context=DATABASE
        )
        try:
            outcome = await asyncio.wait_for(reply, timeout)
        except TimeoutError:
            outcome = NoAnswer(f"no answer within {timeout:g}s", timed_out=True)
        self._stage.note(who, f"<- {upstream.name}: {describe(outcome)}")
        return outcome


class SimProber:
    """gateway.probes.Prober's ``probe``, asking the simulated upstream's search."""

    def __init__(self, stage: Stage, upstreams: dict[str, SimUpstream], who: str) -> None:
        self.stage = stage
        self._upstreams = upstreams
        self._who = who

    async def probe(self, policy: UpstreamPolicy, derived_key: str) -> StoredResponse | None:
        loop = asyncio.get_running_loop()
        upstream = self._upstreams[policy.name]
        owner = OWNER.get()
        who = owner.name if owner else self._who
        self.stage.hazard(who, policy.timeout.total_seconds())
        fate = (
            self.stage.chaos.pick([ProbeFate.FAILS, ProbeFate.SLOW])
            if self.stage.faulty(f"probe:{policy.name}")
            else ProbeFate.OK
        )
        timeout = policy.timeout.total_seconds()
        self.stage.probing(who, upstream)
        found: asyncio.Future[StoredResponse | None] = loop.create_future()

        def look() -> None:
            if fate is ProbeFate.SLOW:
                return
            if fate is ProbeFate.FAILS:
                loop.call_later(back, _fail, found, context=DATABASE)
                return
            result = upstream.search(derived_key, loop.time())
            self.stage.note(upstream.name, f"search {derived_key[:12]}: {'found' if result else 'nothing'}")
            loop.call_later(back, _settle, found, result, context=DATABASE)

        back = self.stage.net.between(*NET)
        loop.call_later(self.stage.net.between(*NET), look, context=DATABASE)
        try:
            return await asyncio.wait_for(found, timeout)
        except TimeoutError:
            raise ProbeFailed(f"the probe of {policy.name} did not answer in time") from None


def _fail(found: asyncio.Future[StoredResponse | None]) -> None:
    if not found.done():
        found.set_exception(ProbeFailed("the probe answered 503"))


def _settle(found: asyncio.Future[StoredResponse | None], result: StoredResponse | None) -> None:
    if not found.done():
        found.set_result(result)
