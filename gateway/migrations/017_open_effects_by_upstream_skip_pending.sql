-- A new effect's claim writes two index entries into open_effects, not four.
--
-- Every claim puts its pending effect into open_effects, and every settle takes it out again. The
-- indexes that list an upstream's open effects, and a tenant's at one upstream (011, 012), took an entry
-- for each of those pending effects too: 177 of the 2,540 bytes of WAL a new effect writes, and two
-- index insertions of Postgres's time, for effects that nearly always complete a few milliseconds
-- later. Those indexes are there for backlogs: effects in doubt or waiting for review pile up by the
-- hundred thousand, and a list of one upstream's must not read every other upstream's pile. Pending
-- effects do not pile up: there are as many as requests in flight, plus those a crash left behind,
-- which recovery moves on within a sweep. So these two indexes now leave pending effects out, and an
-- upstream's list of pending effects reads the gateway's pending range of open_effects' key (or the
-- tenant's, of open_effects_by_tenant) and keeps that upstream's rows.
--
-- open_effects_by_tenant keeps every open effect, pending ones too: a tenant's counts (every health
-- request with a token) and lists read its own rows and never another tenant's, however many requests
-- the others have in flight.
--
-- The statements that read these indexes say "state <> 'pending'" in so many words: Postgres uses a
-- partial index only where the statement implies its predicate, and in a generic plan a state given as
-- a parameter implies nothing.
--
-- Cost of the migration: a plain create index blocks writes to open_effects, so new effects wait,
-- while each is built: about a second per million open effects (open_effects holds only the effects
-- not completed). A gateway from before it, running beside one after it, gives the same answers; its
-- lists of an upstream's open effects read the state's range of the key, as before 011.

drop index if exists open_effects_by_upstream;
drop index if exists open_effects_by_tenant_upstream;

create index open_effects_by_upstream on open_effects (upstream, state, id) where state <> 'pending';
create index open_effects_by_tenant_upstream on open_effects (tenant, upstream, state, id)
    where state <> 'pending';
