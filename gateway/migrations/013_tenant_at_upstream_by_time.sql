-- A tenant's page of the audit at one upstream reads its own effects, however many the tenant has
-- at the others.
--
-- Such a page was a range of effects_tenant (tenant, created_at, id) with the upstream filtered row by
-- row: a tenant with 300,000 effects at one upstream and ten at another read the 300,000 (145 ms) for a
-- page of the ten, and at the tens of millions it ran into statement_timeout (a 503 on the admin API
-- and the audit page). 012 did the same for the open effects; this index does it for the audit.
--
-- Cost: one more index entry for every new effect, about 40 bytes of index per effect and 25-90 bytes
-- of WAL beside its 2.3 KB (measured on the embedded Postgres 18). A plain create index (migrations
-- run in a transaction) blocks writes to the audit, so new effects wait, while it is built: 1.8 s per
-- million effects here; on a large audit, run "effect-gateway migrate" in a maintenance window, or
-- build it beforehand without blocking, month by month (docs/operations.md), and this migration then
-- finds it there. A gateway from before it runs on beside one after it unharmed: the index changes
-- what a page reads, not what a claim writes.

-- Built beforehand but not finished (a month's index not yet attached, or its concurrent build
-- failed): the index of the audit is invalid, which "if not exists" would take for done. It is built
-- again here.
do $$
begin
    if exists (select from pg_index i join pg_class c on c.oid = i.indexrelid
               where c.relname = 'effects_tenant_upstream' and not i.indisvalid
                 and c.relnamespace = (select relnamespace from pg_class where oid = 'effects'::regclass)) then
        drop index effects_tenant_upstream;
    end if;
end $$;

create index if not exists effects_tenant_upstream on effects (tenant, upstream, created_at, id);
