-- A table that can grow to billions of rows without stalling traffic.
--
-- effect_keys    one slim row per (tenant, upstream, key): the key stays unique across all time, and
--                the lookup of a retried key is one index probe whatever the size of the audit.
-- effects        the audit row, partitioned by month of creation: old months can be detached and
--                archived (pg_dump of a partition) without touching the rest. No bodies here, so a row
--                stays small after the retention.
-- effect_bodies  request and response headers and bodies, partitioned by day of storage: the retention
--                drops whole days (detach concurrently, then drop) instead of updating rows.
--
-- Why a key table rather than the partition key inside the unique key: a unique index on a partitioned
-- table must contain the partition key, so (tenant, upstream, key, created_at) would let a retry a day
-- later insert a second row for the same key in the next month's partition; the claim would then have to
-- search older partitions under a lock of its own. The key table keeps uniqueness where Postgres can
-- enforce it, and costs about 100 bytes a key.

create sequence effect_ids as bigint;

-- Creates the partition of ``parent`` for [lower, upper) unless it exists. It is made as a table of its
-- own and then attached: attaching takes only a SHARE UPDATE EXCLUSIVE lock on the parent, which
-- reads and writes do not wait for (CREATE TABLE .. PARTITION OF would take ACCESS EXCLUSIVE). Gateways
-- that start at once serialise on the advisory lock (released at the end of the caller's transaction).
create function effect_gateway_partition(parent text, lower timestamptz, upper timestamptz, name text)
returns void language plpgsql as $$
begin
    perform pg_advisory_xact_lock(hashtext('effect_gateway_partition'));
    if to_regclass(name) is null then
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

create table effect_keys (
    tenant     text        not null,
    upstream   text        not null,
    key        text        not null,
    effect_id  bigint      not null,
    created_at timestamptz not null,
    primary key (tenant, upstream, key)
);

alter table effects rename to effects_v2;
alter index effects_pkey rename to effects_v2_pkey;
alter table effects_v2 rename constraint effects_tenant_upstream_key_key to effects_v2_tenant_upstream_key_key;
drop index effects_open_states, effects_created_at, effects_run, effects_purgeable;

create table effects (
    id               bigint      not null default nextval('effect_ids'),
    created_at       timestamptz not null default now(),
    tenant           text        not null,
    upstream         text        not null,
    key              text        not null,
    derived_key      text        not null,
    method           text        not null,
    path             text        not null,
    query            text        not null default '',
    fingerprint      text        not null,
    state            text        not null
        check (state in ('pending', 'completed', 'retryable', 'in_doubt', 'needs_review')),
    attempt          integer     not null default 1 check (attempt >= 1),
    may_have_sent    boolean     not null default false,
    lease_expires_at timestamptz,
    response_status  integer,
    -- When the response now on record was stored: it is found in effect_bodies at this time, and once
    -- its day has been dropped by the retention, the effect's response is gone ("purged").
    response_at      timestamptz,
    recovered_by     text
        check (recovered_by in ('native_key', 'probe', 'operator', 'harmless', 'never_sent')),
    run_id           text,
    step             text,
    first_sent_at    timestamptz,
    last_sent_at     timestamptz,
    completed_at     timestamptz,
    replays          integer     not null default 0,
    keyless          boolean     not null default false,
    history          jsonb       not null default '[]',
    primary key (id, created_at)
) partition by range (created_at);

-- What the admin API filters on, each with id order for paging.
create index effects_tenant on effects (tenant, id);
create index effects_upstream on effects (upstream, id);
create index effects_run on effects (run_id, id) where run_id is not null;
-- The open states (a small part of the table): their counts, and the list of what needs review.
create index effects_open on effects (state, id) where state <> 'completed';

create table effect_bodies (
    effect_id bigint      not null,
    stored_at timestamptz not null,
    kind      text        not null check (kind in ('request', 'response')),
    -- "Name: value" lines joined by CRLF, the bytes as they were (request headers redacted).
    headers   bytea       not null default '',
    body      bytea       not null default '',
    primary key (effect_id, kind, stored_at)
) partition by range (stored_at);

-- Partitions for the rows kept from the previous layout (months of the audit, days of kept bodies).
do $$
declare
    month timestamptz;
    day   timestamptz;
begin
    for month in
        select generate_series(
            date_trunc('month', coalesce(min(created_at), now()) at time zone 'UTC'),
            date_trunc('month', now() at time zone 'UTC'),
            interval '1 month'
        ) at time zone 'UTC' from effects_v2
    loop
        perform effect_gateway_partition(
            'effects', month, (month at time zone 'UTC' + interval '1 month') at time zone 'UTC',
            'effects_' || to_char(month at time zone 'UTC', 'YYYY_MM')
        );
    end loop;
    for day in
        select generate_series(
            date_trunc('day', coalesce(min(created_at), now()) at time zone 'UTC'),
            date_trunc('day', now() at time zone 'UTC'),
            interval '1 day'
        ) at time zone 'UTC' from effects_v2 where request_body is not null or response_body is not null
    loop
        perform effect_gateway_partition(
            'effect_bodies', day, day + interval '1 day',
            'effect_bodies_' || to_char(day at time zone 'UTC', 'YYYY_MM_DD')
        );
    end loop;
end $$;

select setval('effect_ids', coalesce((select max(id) from effects_v2), 0) + 1, false);

insert into effect_keys (tenant, upstream, key, effect_id, created_at)
select tenant, upstream, key, id, created_at from effects_v2;

insert into effects (id, created_at, tenant, upstream, key, derived_key, method, path, query, fingerprint,
    state, attempt, may_have_sent, lease_expires_at, response_status, response_at, recovered_by, run_id,
    step, first_sent_at, last_sent_at, completed_at, replays, keyless, history)
select id, created_at, tenant, upstream, key, derived_key, method, path, query, fingerprint,
    state, attempt, may_have_sent, lease_expires_at, response_status,
    case when response_body is not null then created_at end, recovered_by, run_id,
    step, first_sent_at, last_sent_at, completed_at, replays, keyless, history
from effects_v2;

-- Bodies kept so far are stored as of the effect's creation: the retention counts from there.
insert into effect_bodies (effect_id, stored_at, kind, headers, body)
select id, created_at, 'request',
    convert_to(coalesce((select string_agg(h.key || ': ' || h.value, E'\r\n')
                         from jsonb_each_text(request_headers) as h), ''), 'UTF8'),
    request_body
from effects_v2 where request_body is not null;

insert into effect_bodies (effect_id, stored_at, kind, headers, body)
select id, created_at, 'response', coalesce(response_headers, ''), response_body
from effects_v2 where response_body is not null;

drop table effects_v2;
