-- A new effect's claim writes two index entries into open_effects, not four.
--
-- Every claim puts its pending effect into open_effects, and every settle takes it out again. The
-- indexes that list an upstream's open effects, and a tenant's at one upstream (011, 012), took an entry
-- for each of those pending effects too: 173 of the 2,543 bytes of WAL a new effect wrote (claims and
-- outcomes batched by 16), and Postgres's time for two index insertions, for effects that nearly
-- always complete a few milliseconds later. Those indexes are there for backlogs: effects in doubt or
-- waiting for review pile up by the hundred thousand, and a list of one upstream's must not read every
-- other upstream's pile. Pending effects do not pile up: there are as many as requests in flight, plus
-- those a crash left behind, which recovery moves on within a sweep. So the two indexes are replaced by
-- ones that leave pending effects out ("waiting": in doubt, retryable or waiting for review), and an
-- upstream's list of pending effects reads the gateway's pending range of open_effects' key (or the
-- tenant's, of open_effects_by_tenant) and keeps that upstream's rows.
--
-- open_effects_by_tenant keeps every open effect, pending ones too: a tenant's counts (every health
-- request with a token) and lists read its own rows and never another tenant's, however many requests
-- the others have in flight.
--
-- The statements that read the new indexes say "state <> 'pending'" in so many words: Postgres uses a
-- partial index only where the statement implies its predicate, and in a generic plan a state given as
-- a parameter implies nothing.
--
-- Cost of the migration: a plain create index blocks writes to open_effects (claims, settles and
-- recovery wait) while it is built, about 1.5 s per million open effects for each. To avoid that, build
-- both beforehand outside a transaction, and this migration then finds them there:
--   create index concurrently open_effects_waiting_by_upstream on open_effects (upstream, state, id)
--       where state <> 'pending';
--   create index concurrently open_effects_waiting_by_tenant_upstream
--       on open_effects (tenant, upstream, state, id) where state <> 'pending';
-- Dropping the old indexes then holds the table's strongest lock for a moment only. A gateway from
-- before this migration, running beside one after it, gives the same answers, but its list of one
-- upstream's open effects reads every open effect, and a tenant's at one upstream all the tenant's.

-- A concurrent build that failed or was cancelled leaves an invalid index of that name, which the
-- planner never uses and "if not exists" would take for done: it is built again. (A build still running
-- counts as invalid too: migrate after it has ended.)
do $$
declare
    name text;
begin
    foreach name in array array['open_effects_waiting_by_upstream', 'open_effects_waiting_by_tenant_upstream'] loop
        if exists (select from pg_index i join pg_class c on c.oid = i.indexrelid
                   where c.relname = name and not i.indisvalid
                     and c.relnamespace = (select relnamespace from pg_class where oid = 'open_effects'::regclass)) then
            execute format('drop index %I', name);
        end if;
    end loop;
end $$;

create index if not exists open_effects_waiting_by_upstream on open_effects (upstream, state, id)
    where state <> 'pending';
create index if not exists open_effects_waiting_by_tenant_upstream on open_effects (tenant, upstream, state, id)
    where state <> 'pending';

drop index if exists open_effects_by_upstream;
drop index if exists open_effects_by_tenant_upstream;
