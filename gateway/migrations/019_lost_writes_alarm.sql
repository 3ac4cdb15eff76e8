-- Where a gateway that finds the database has lost its writes says so, for every worker and every
-- gateway, and for after a restart.
--
-- A worker that finds the newest effect it claimed missing (gateway.lost_writes) refuses new effects.
-- Kept in its memory alone, the refusal would be lost with a restart (a liveness probe, an upgrade),
-- and the workers and gateways that had claimed nothing lately would go on sending what the database
-- forgot. The row here makes every one of them refuse until an operator, having reconciled, deletes it
-- (docs/operations.md, "Backups and lost writes").

create table if not exists effect_gateway_alarms (
    kind      text        primary key check (kind in ('lost-writes')),
    detail    text        not null,
    raised_at timestamptz not null default now()
);
