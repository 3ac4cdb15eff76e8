-- An upstream's open effects, listed without looking up every other upstream's audit rows.
--
-- open_effects held no upstream, so the audit filtered by an open state and an upstream looked up the
-- audit row of each effect in the state's range, newest first, and threw away the other upstreams':
-- with 95,000 waiting for review at one upstream, a page of another's read all 95,000 audit rows
-- (194 ms). Now the upstream is on the open effect's row, so the filter is applied there, and the
-- index (upstream, state, id) makes an upstream's list a range of its own. A tenant's list of one
-- upstream reads the tenant's range of open_effects_by_tenant and filters on this column, reading the
-- audit only for the rows of its page.
--
-- Cost: one more index entry for each claim and each change between open states (open_effects holds
-- only the effects not completed, so the index stays small). The fill rewrites every row of the table
-- (a dead row each, for vacuum) and holds its strongest lock until the end: about 20 s per million
-- open effects, well under a second for a backlog of thousands. Gateways' statements on open effects
-- wait for it up to their lock_timeout, then fail (a new effect's claim is a 503; a settle that fails
-- leaves its effect to recovery), so stop the gateways when the backlog is large. Every claim now
-- writes the upstream: a gateway from before this migration, left running beside a newer one, fails
-- each new effect's claim and sends nothing.

alter table open_effects add column upstream text;

-- One lookup of the audit's primary key per open effect, so the time grows with the open effects only:
-- as a join, Postgres hashes the whole audit (a third quicker at 1.2M audit rows; at a billion it would
-- read them all).
update open_effects o set upstream = (
    select e.upstream from effects e where e.id = o.id and e.created_at = o.created_at
);

-- An open effect whose month of the audit was archived while it was still open has no audit row to
-- take its upstream from; its key (effect_keys, which archiving keeps) has it. One pass over the keys
-- for all such effects, and only when there are any: effect_keys has no index by effect.
do $$
declare
    lost bigint;
begin
    if exists (select from open_effects where upstream is null) then
        update open_effects o set upstream = k.upstream
        from effect_keys k
        where o.upstream is null and k.effect_id = o.id;
        select count(*) into lost from open_effects where upstream is null;
        if lost > 0 then
            raise exception 'open effects with neither an audit row nor a key: % (archived with their month while still open: the rows of open_effects whose id is in neither effects nor effect_keys); restore that month and its keys, or delete those rows if you know how each ended, then migrate again', lost;
        end if;
    end if;
end $$;

alter table open_effects alter column upstream set not null;

create index open_effects_by_upstream on open_effects (upstream, state, id);

-- The new column's statistics, for the lists' plans until autovacuum's analyze comes round.
analyze open_effects;
