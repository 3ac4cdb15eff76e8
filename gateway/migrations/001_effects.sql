-- The audit of every side effect: one row per (tenant, upstream, key).
create table effects (
    id               bigint generated always as identity primary key,
    tenant           text        not null,
    upstream         text        not null,
    key              text        not null,
    derived_key      text        not null,
    method           text        not null,
    path             text        not null,
    query            text        not null default '',
    fingerprint      text        not null,
    -- Redacted: credentials, injected and secret headers never reach this table.
    request_headers  jsonb       not null default '{}',
    request_body     bytea,
    state            text        not null
        check (state in ('pending', 'completed', 'retryable', 'in_doubt', 'needs_review')),
    attempt          integer     not null default 1 check (attempt >= 1),
    may_have_sent    boolean     not null default false,
    lease_expires_at timestamptz,
    response_status  integer,
    -- An array of [name, value] pairs: order and repeated headers are kept for a byte-identical replay.
    response_headers jsonb,
    response_body    bytea,
    recovered_by     text
        check (recovered_by in ('native_key', 'probe', 'operator', 'harmless', 'never_sent')),
    run_id           text,
    step             text,
    created_at       timestamptz not null default now(),
    first_sent_at    timestamptz,
    last_sent_at     timestamptz,
    completed_at     timestamptz,
    replays          integer     not null default 0,
    purged_at        timestamptz,
    history          jsonb       not null default '[]',
    unique (tenant, upstream, key)
);

create index effects_open_states on effects (state) where state <> 'completed';
create index effects_created_at on effects (created_at);
create index effects_run on effects (run_id) where run_id is not null;
create index effects_purgeable on effects (completed_at) where purged_at is null and state = 'completed';
