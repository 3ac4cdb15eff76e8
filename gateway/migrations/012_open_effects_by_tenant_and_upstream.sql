-- A tenant's open effects at one upstream, read without stepping through the tenant's others.
--
-- After 011 a tenant's list of an open state at one upstream read the tenant's range of
-- open_effects_by_tenant and filtered on the upstream: the rows skipped are the tenant's newer effects
-- at other upstreams, which no cursor passes over. With 95,000 of a tenant's effects waiting at one
-- upstream, a page of its 30 at another read the 95,000 (33 ms; it grows with that backlog). This index
-- makes the list a range of its own.
--
-- Cost: about 40 bytes an open effect (open_effects holds only the effects not completed), and one more
-- index entry for every claim and every change between open states. A plain create index (migrations
-- run in a transaction) blocks writes to open_effects, so new effects wait, while it is built: about a
-- second per million open effects; with many millions open, build it beforehand with "create index
-- concurrently open_effects_by_tenant_upstream on open_effects (tenant, upstream, state, id)" outside
-- a transaction, and this migration then finds it there. A gateway from before it runs on beside one
-- after it unharmed: the index changes what a list reads, not what a claim writes.

-- A concurrent build that failed or was cancelled leaves an invalid index of that name, which the
-- planner never uses and "if not exists" would take for done: it is built again. (A build still running
-- counts as invalid too: migrate after it has ended.)
do $$
begin
    if exists (select from pg_index i join pg_class c on c.oid = i.indexrelid
               where c.relname = 'open_effects_by_tenant_upstream' and not i.indisvalid
                 and c.relnamespace = (select relnamespace from pg_class where oid = 'open_effects'::regclass)) then
        drop index open_effects_by_tenant_upstream;
    end if;
end $$;

create index if not exists open_effects_by_tenant_upstream on open_effects (tenant, upstream, state, id);
