-- The partitions ahead, made by a gateway whose role may not make tables.
--
-- Making a partition is DDL: CREATE TABLE needs CREATE on the schema, and attaching it needs ownership
-- of the partitioned table. A gateway that runs with a role of reads and writes only (docs/operations.md,
-- "Database roles") could therefore make none: once the days made ahead ran out, every new effect was
-- refused, and an answer that arrived then could not be stored. This function runs as the role that
-- migrated (SECURITY DEFINER, so as the tables' owner) and makes only what it computes itself: the
-- day of effect_bodies that holds rows stored now and the days after it, and the month of effects that
-- holds rows created now and the months after it, never more than it allows below. Its caller names no
-- table and no time, so EXECUTE on it grants nothing but partitions made ahead of need.
--
-- Times are UTC whatever the caller's session says (the partitions' bounds and names are UTC days and
-- months), and the search path is the schema the tables are in, so that no object of the caller's can
-- stand in for one of ours inside it.

create or replace function effect_gateway_make_partitions(days_ahead integer, months_ahead integer)
returns void language plpgsql security definer as $$
declare
    part record;
begin
    -- A month of days covers any sensible "ahead", and keeps a caller from making thousands of tables.
    if days_ahead is null or months_ahead is null or days_ahead not between 0 and 31
       or months_ahead not between 0 and 2 then
        raise exception 'partitions are made 0 to 31 days and 0 to 2 months ahead, not % days and % months',
            days_ahead, months_ahead;
    end if;
    for part in
        select 'effect_bodies' as parent, d as lower, d + interval '1 day' as upper,
               'effect_bodies_' || to_char(d, 'YYYY_MM_DD') as name
        from generate_series(date_trunc('day', now()), date_trunc('day', now()) + days_ahead * interval '1 day',
                             interval '1 day') as d
        union all
        select 'effects', m, m + interval '1 month', 'effects_' || to_char(m, 'YYYY_MM')
        from generate_series(date_trunc('month', now()),
                             date_trunc('month', now()) + months_ahead * interval '1 month',
                             interval '1 month') as m
    loop
        -- A table of that name that is not a partition (a retention round stopped between its detach
        -- and its drop, or a table moved aside by hand) would be taken for the partition and the
        -- rows would still have no home: say so rather than leave them without one.
        if to_regclass(part.name) is not null and not exists (
            select from pg_inherits
            where inhrelid = to_regclass(part.name) and inhparent = to_regclass(part.parent)
        ) then
            raise exception 'a table named % is in the way of the partition of % for % to %: it is not a '
                'partition of it; drop it or rename it (effect-gateway purge, run by the owner, drops a day '
                'of bodies that a retention round detached and did not drop)',
                part.name, part.parent, part.lower, part.upper;
        end if;
        perform effect_gateway_partition(part.parent, part.lower, part.upper, part.name);
    end loop;
end $$;

do $$
begin
    execute format(
        'alter function effect_gateway_make_partitions(integer, integer) set search_path = %I, pg_temp',
        current_schema()
    );
end $$;
alter function effect_gateway_make_partitions(integer, integer) set timezone = 'UTC';

-- Functions may be called by anyone unless told otherwise; this one only by the roles granted it
-- (effect-gateway migrate --grant-to ROLE).
revoke execute on function effect_gateway_make_partitions(integer, integer) from public;
