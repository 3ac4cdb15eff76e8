-- The audit's chain: each settlement of an effect, linked by hashes per tenant, and its signed heads
-- (gateway/chain.py says what it proves and what it does not).
--
-- unchained    each settlement not yet in the chain, written by the statement that settles the effect
--              (a completion, an operator's verdict). The chainer (gateway/chaining.py) moves them into
--              audit_chain, in the order they settled, about once a second: the table holds only the
--              last second or so of settlements. The settle statement writes one row here and nothing
--              more, so the chain costs a request no lock it would wait for.
-- audit_chain  one entry per settlement, numbered per tenant without gaps (seq), each with the hash of
--              its facts and of the entry before it. The runtime role may only add to it: the retention
--              drops bodies and the months of the audit may be detached, but the chain stays whole.
--              (It may also drop settlements not yet chained: the round that moves them deletes them.)
-- chained_tenants  the tenants that have a chain (each one's newest entry is read from audit_chain,
--              whose primary key finds it at once: the chain alone says where it goes on).
-- audit_heads  the tips signed (Ed25519) at intervals and on demand.
--
-- The effects settled before this migration stay out of the chain: it starts with the first one after.
-- Digests and hashes are kept as their 32 bytes, not as hex: 100 bytes less per settlement in the WAL.

create table if not exists unchained (
    scope        uuid        not null,
    effect_id    bigint      not null,
    -- One settlement per attempt: a completion ends the effect, and a verdict that it did not happen
    -- leaves it retryable, which only a new attempt leaves.
    attempt      integer     not null,
    tenant       text        not null,
    upstream     text        not null,
    method       text        not null,
    path         text        not null,
    fingerprint  text        not null,
    outcome      text        not null check (outcome in ('completed', 'not_happened')),
    status       integer,
    response     bytea,
    recovered_by text,
    by           text,
    run_id       text,
    step         text,
    created_at   timestamptz not null,
    settled_at   timestamptz not null default now(),
    primary key (scope, effect_id, attempt)
);

create table if not exists audit_chain (
    tenant       text        not null,
    seq          bigint      not null check (seq >= 1),
    scope        uuid        not null,
    effect_id    bigint      not null,
    attempt      integer     not null,
    upstream     text        not null,
    method       text        not null,
    path         text        not null,
    fingerprint  text        not null,
    outcome      text        not null,
    status       integer,
    response     bytea,
    recovered_by text,
    by           text,
    run_id       text,
    step         text,
    created_at   timestamptz not null,
    settled_at   timestamptz not null,
    hash         bytea       not null,
    primary key (tenant, seq)
);
-- An export of a period finds its entries by their settling time, which grows with seq but for the
-- settlements of the same second: a BRIN index, a few pages for any size, and nearly free to keep.
create index if not exists audit_chain_settled_at on audit_chain using brin (settled_at);

create table if not exists chained_tenants (
    tenant text primary key
);

create table if not exists audit_heads (
    tenant    text        not null,
    seq       bigint      not null,
    hash      text        not null,
    signed_at timestamptz not null,
    key       text        not null,
    signature text        not null,
    primary key (tenant, seq)
);
