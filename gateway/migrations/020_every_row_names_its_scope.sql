-- Every row of an effect names its scope, so that the tables can be sharded.
--
-- A distributed Postgres (Citus) spreads a table over shards by one column, and routes a statement to
-- one shard only when its where clause names that column; a primary key or unique key must contain it.
-- An effect's scope is its (tenant, upstream, key), and the column that names it is the key's digest
-- (gateway.keys.key_digest), which effect_keys has held since 005 as "digest": it is renamed "scope",
-- and effects, open_effects and effect_bodies get it too, each in its primary key. Every statement the
-- gateway runs for one effect names it (tests/test_scope.py checks each), so an effect's key, audit row,
-- open state and bodies would live on one shard, and each statement would go to that shard alone.
-- effect_gateway_secrets, effect_gateway_migrations and effect_gateway_alarms hold a few rows about the
-- whole database: they would be reference tables, copied to every node.
--
-- Cost: every audit row, open effect and body kept is written again once, and each primary key built
-- again, while claims wait: on a large audit, run `effect-gateway migrate` in a maintenance window (the
-- operations guide, Upgrading, gives the figures). Stop the older gateways first: their statements name
-- effect_keys.digest, which is gone, and fail (503, nothing sent).

-- A partition whose detach was interrupted (its second transaction never ran) would not get the new
-- column, and could then neither be finished nor altered: the migration waits for it to be finished.
do $$
declare
    pending text;
begin
    select string_agg(c.relname, ', ' order by c.relname) into pending
    from pg_inherits i join pg_class c on c.oid = i.inhrelid
    where i.inhdetachpending and i.inhparent in ('effects'::regclass, 'effect_bodies'::regclass);
    if pending is not null then
        raise exception 'a detach of % was interrupted and must be finished before this migration: for a day of bodies, run effect-gateway purge as the owner with the version you are upgrading from (it finishes the detach and carries forward what open effects still need); for a month of the audit, alter table effects detach partition ... finalize; then migrate again', pending;
    end if;
end $$;

-- Each step is skipped where it was done already, so that the migration can be applied again (a
-- database restored with its schema and an older migrations table, say).
do $$
begin
    if exists (select from pg_attribute where attrelid = 'effect_keys'::regclass and attname = 'digest') then
        alter table effect_keys rename column digest to scope;
    end if;
end $$;

-- Makes ``columns`` the primary key of ``tab`` unless its key has the scope already.
create function pg_temp.key_with_scope(tab regclass, columns text) returns void language plpgsql as $$
begin
    if not exists (select from pg_constraint c join pg_attribute a on a.attrelid = c.conrelid
                   where c.conrelid = tab and c.contype = 'p' and a.attnum = any(c.conkey)
                     and a.attname = 'scope') then
        execute format('alter table %s drop constraint %I', tab, tab::text || '_pkey');
        execute format('alter table %s add constraint %I primary key (%s)', tab, tab::text || '_pkey', columns);
    end if;
end $$;

alter table effects add column if not exists scope uuid;
update effects set scope = effect_key_digest(key) where scope is null;
alter table effects alter column scope set not null;
-- The id first, as before: the admin reads an effect by its id alone. The scope before the time: a
-- settle looks many rows up at once (id = any(..) and scope = any(..)), and Postgres before 17 takes a
-- list for a column after one bounded by a range (the month) as a filter, not as part of the lookup.
select pg_temp.key_with_scope('effects', 'id, scope, created_at');

alter table open_effects add column if not exists scope uuid;
update open_effects o set scope = e.scope
from effects e where o.scope is null and e.id = o.id and e.created_at = o.created_at;
-- An effect still open when its month was archived has no audit row; its key (which 011 made sure of)
-- has the scope. effect_keys has no index by effect, so it is read only when there are any.
do $$
begin
    if exists (select from open_effects where scope is null) then
        update open_effects o set scope = k.scope from effect_keys k where o.scope is null and k.effect_id = o.id;
    end if;
    if exists (select from open_effects where scope is null) then
        raise exception 'open effects with neither an audit row nor a key: % (the rows of open_effects whose id is in neither effects nor effect_keys); delete them if you know how each ended, or restore their month and keys, then migrate again',
            (select count(*) from open_effects where scope is null);
    end if;
end $$;
alter table open_effects alter column scope set not null;
select pg_temp.key_with_scope('open_effects', 'state, id, scope');

alter table effect_bodies add column if not exists scope uuid;
update effect_bodies b set scope = e.scope from effects e where b.scope is null and e.id = b.effect_id;
do $$
begin
    if exists (select from effect_bodies where scope is null) then
        update effect_bodies b set scope = k.scope from effect_keys k where b.scope is null and k.effect_id = b.effect_id;
    end if;
    if exists (select from effect_bodies where scope is null) then
        raise exception 'bodies of effects with neither an audit row nor a key: % (the rows of effect_bodies whose effect_id is in neither effects nor effect_keys); delete them, or restore their month and keys, then migrate again',
            (select count(*) from effect_bodies where scope is null);
    end if;
end $$;
alter table effect_bodies alter column scope set not null;
select pg_temp.key_with_scope('effect_bodies', 'effect_id, kind, stored_at, scope');

drop function pg_temp.key_with_scope(regclass, text);
