-- A tenant's open effects, read without stepping through every other tenant's.
--
-- open_effects' key (state, id) serves the whole gateway's counts and lists of an open state. A tenant's
-- count (health and metrics with a tenant's token) and its list of an open state (the audit filtered by
-- state) read that range and threw away the other tenants' rows: with a million pending effects of one
-- tenant, another tenant's count of its ten read the million. This index makes each a range of its own.
--
-- Cost: open_effects holds only the effects not completed, so this is small next to the audit (about
-- 40 bytes an open effect); every claim and every change between open states writes one more index
-- entry. A plain create index (migrations run in a transaction) blocks writes to open_effects, so new
-- effects wait, while it is built: about a second per million open effects; on a table with many
-- millions, build it beforehand with "create index concurrently open_effects_by_tenant on open_effects
-- (tenant, state, id)" outside a transaction, and this migration then finds it there.

-- A concurrent build that failed or was cancelled leaves an invalid index of that name, which the
-- planner never uses and "if not exists" would take for done: it is built again.
do $$
begin
    if exists (select from pg_index i join pg_class c on c.oid = i.indexrelid
               where c.relname = 'open_effects_by_tenant' and not i.indisvalid
                 and c.relnamespace = (select relnamespace from pg_class where oid = 'open_effects'::regclass)) then
        drop index open_effects_by_tenant;
    end if;
end $$;

create index if not exists open_effects_by_tenant on open_effects (tenant, state, id);
