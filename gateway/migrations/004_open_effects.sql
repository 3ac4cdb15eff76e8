-- The open states apart from the audit row, so that a settle is a HOT update.
--
-- Until now the partial index effects_open (state, id) where state <> 'completed' found the open
-- effects. An index on a column, or in its predicate, makes every update that changes that column a
-- non-HOT one: the settle (pending -> completed) wrote a new row version and a new entry into each of
-- the audit's indexes (primary key, tenant, upstream, run), and those indexes grew by two entries per
-- effect. Now no index of effects holds a column that the settle, a take-over or the replay counter
-- changes, so those updates stay on their page (fillfactor 85 leaves room) and touch no index.
--
-- open_effects has a row for each effect not completed (pending, retryable, in_doubt, needs_review):
-- written by the claim, moved by every change of state in the same statement as the audit row, and
-- deleted when the effect completes (it never leaves completed). It stays as small as the number of
-- effects in flight or waiting for someone; its key (state, id) serves the counts and the lists of an
-- open state in id order.

create table open_effects (
    state      text        not null check (state in ('pending', 'retryable', 'in_doubt', 'needs_review')),
    id         bigint      not null,
    created_at timestamptz not null,
    tenant     text        not null,
    primary key (state, id)
);

insert into open_effects (state, id, created_at, tenant)
select state, id, created_at, tenant from effects where state <> 'completed';

drop index effects_open;
