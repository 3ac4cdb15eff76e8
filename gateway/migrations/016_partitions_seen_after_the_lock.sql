-- Making a partition: whether it exists is asked of the catalog itself, after the lock.
--
-- Several gateways that find the same day of bodies missing call effect_gateway_partition at once; it
-- takes an advisory lock and makes the table only if it is not there. It asked to_regclass, which answers
-- from the session's catalog cache: taking an advisory lock reads no catalog invalidations, so a session
-- that had looked the name up before the lock (effect_gateway_make_partitions does) still saw no table
-- after another session made it, tried to make it again and failed with duplicate_table. Each such
-- failure was a write that found no partition and an answer lost (four of thirty in a test). A query of
-- pg_class reads the catalog under a snapshot taken after the lock.
create or replace function effect_gateway_partition(parent text, lower timestamptz, upper timestamptz, name text)
returns void language plpgsql as $$
begin
    perform pg_advisory_xact_lock(hashtext('effect_gateway_partition'));
    if not exists (
        select from pg_class where relname = name and relnamespace = current_schema()::regnamespace
    ) then
        -- fillfactor 85 on the audit: room on each page for the settle's new row version, so that
        -- updates that change no indexed column stay on the page (HOT) and add no index entries.
        execute format(
            'create table %I (like %I including defaults including constraints)%s',
            name, parent, case when parent = 'effects' then ' with (fillfactor = 85)' else '' end
        );
        execute format(
            'alter table %I attach partition %I for values from (%L) to (%L)', parent, name, lower, upper
        );
    end if;
end $$;
