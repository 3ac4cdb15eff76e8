"""Whether the database still holds what this gateway wrote: checked in every claim.

A database can forget committed writes: a failover to a standby that had not yet received them (an
asynchronous one, or a synchronous one that was not in sync), a restore of a backup to an earlier
point. A claim it forgot is the one failure the gateway cannot see on its own: a retry of that key
looks new, and the effect would be sent a second time. So each worker remembers the newest effect it
claimed (its witness), and the claim statement inserts nothing unless the database still holds it;
every connection the pool opens looks it up too. Once it is missing, the worker raises an alarm in
the database (migration 019), and every worker of every gateway, whose claims the statement also
holds back while the alarm is there, refuses every new effect (503 ``database-lost-writes``) until an
operator has reconciled and deleted it (docs/operations.md, "Backups and lost writes"). The claim
checks it, not only a new connection: a pooler keeps the gateway's connections across a failover.

What this cannot see: a loss noticed by no worker (none had claimed anything the database forgot, or
the workers that had were restarted since); and this worker's outcomes and take-overs committed after
its newest claim (those fall back to in-doubt handling: a probe, or an operator).
"""

from __future__ import annotations

import logging
import uuid
from typing import NamedTuple

from gateway.errors import WritesLost
from gateway.partitions import AnyConn
from gateway.record import EffectRecord

log = logging.getLogger("effect_gateway")


# Whether a failover could lose a commit: a standby streams from this server (every role sees the rows
# of pg_stat_replication), and Postgres waits for none before it says a commit is done.
_DURABILITY = """
    select exists (select from pg_stat_replication) as streams,
           current_setting('synchronous_standby_names') = '' as no_standby,
           current_setting('synchronous_commit') in ('off', 'local') as not_waited
"""


async def failover_warning(conn: AnyConn) -> str | None:
    """What a failover could lose, in words for the health route; None when commits wait for a
    synchronous standby."""
    row = await conn.fetchrow(_DURABILITY)
    assert row is not None  # one row, always
    if not row["streams"] or not (row["no_standby"] or row["not_waited"]):
        return None  # no standby to fail over to (or a service's own, out of sight), or one in sync
    why = (
        "synchronous_standby_names is empty"
        if row["no_standby"]
        else "synchronous_commit does not wait for the standby"
    )
    return (
        f"Postgres confirms a commit before any standby has it ({why}): a failover to a standby could "
        "lose claims the gateway has acted on, which it would then send again (unless the service "
        "replicates its storage synchronously); see docs/operations.md, Backups and lost writes"
    )


class Witness(NamedTuple):
    """A claim the database must still hold: its id, and its key as effect_keys holds it (kept when a
    month of the audit is archived)."""

    effect_id: int
    tenant: str
    upstream: str
    scope: uuid.UUID


class LostWrites:
    """This worker's newest claim, and the loss of writes once one is found."""

    def __init__(self) -> None:
        # The newest claim this worker made: every claim and every new connection look it up.
        self.newest: Witness | None = None
        self.lost: str | None = None
        # Whether the alarm of ``lost`` is in the database (seen there, or written): only then does a
        # table without it mean that an operator deleted it. Found by this worker and not yet written
        # (the insert failed), the alarm is written again at the next look, never taken as deleted.
        self._on_record = False

    def wrote(self, record: EffectRecord) -> None:
        """Remember ``record``, just claimed (committed), if it is the newest this worker claimed."""
        if self.newest is None or record.id > self.newest.effect_id:
            self.newest = Witness(record.id, record.tenant, record.upstream, record.scope)

    def refuse_if_lost(self) -> None:
        """Raise WritesLost once the database has been found to have forgotten writes."""
        if self.lost is not None:
            raise WritesLost(self.lost)

    async def heed(self, conn: AnyConn) -> None:
        """Take up the alarm as the database holds it: raised by any worker, or deleted by an operator
        who has reconciled (then this worker's newest claim, gone for good, is no longer looked for)."""
        raised = await conn.fetchval("select detail from effect_gateway_alarms where kind = 'lost-writes'")
        if raised is not None:
            self.lost, self._on_record = raised, True
        elif self.lost is not None and self._on_record:
            self.lost, self.newest, self._on_record = None, None, False
        elif self.lost is not None:
            await self._raise(conn)

    async def check(self, conn: AnyConn) -> None:
        """On a connection just opened: heed the alarm, else look up the newest claim this worker made,
        and raise the alarm when the database no longer holds it."""
        await self.heed(conn)
        if self.lost is not None or self.newest is None:
            return
        # A standby still replaying (a URL naming several hosts, without target_session_attrs) is not
        # the database to judge: it may simply not have the claim yet.
        if await conn.fetchval("select pg_is_in_recovery()"):
            return
        effect_id, tenant, upstream, scope = self.newest
        found = await conn.fetchval(
            "select exists (select from effect_keys where scope = $1 and tenant = $2 and upstream = $3 "
            "and effect_id = $4)",
            scope,
            tenant,
            upstream,
            effect_id,
        )
        if found:
            return
        self.lost = (
            f"the database no longer holds effect {effect_id}, which a gateway claimed: it has lost "
            "committed writes (a failover to a standby that had not received them, or a restore to an "
            "earlier point), and a retry of a lost claim would look new and be sent again; new effects "
            "are refused until an operator has reconciled and deleted the alarm (see "
            "docs/operations.md, Backups and lost writes)"
        )
        log.error("%s", self.lost)
        await self._raise(conn)

    async def _raise(self, conn: AnyConn) -> None:
        """Write the alarm: every other worker and gateway, and this one after a restart, refuse from
        the row on."""
        assert self.lost is not None
        await conn.execute(
            "insert into effect_gateway_alarms (kind, detail) values ('lost-writes', $1) "
            "on conflict (kind) do nothing",
            self.lost,
        )
        self._on_record = True
