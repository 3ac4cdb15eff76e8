-- What the gateway told an operator about effects that wait for them, and how each delivery went.
--
-- With a [webhook] configured, a worker now and then reads open_effects for effects waiting for review,
-- and in doubt longer than the webhook's in_doubt_after (gateway.notifications), and writes a row here
-- for each: one per (effect, event, attempt), "on conflict do nothing", so that every sweep of every
-- gateway finds a wait it has told of already and adds nothing, while an effect resolved and back in
-- review at a later attempt is told of again. Nothing on the hot path writes here: the claim and the
-- settle are as they were, and without a [webhook] no statement touches this table.
--
-- Each row is then delivered by whichever worker takes it first: taking it moves next_try_at past the
-- delivery's timeout (a lease), so no other takes it while the POST is under way; a worker that dies
-- meanwhile leaves it to be taken again when that time has passed. tries, last_status, last_error,
-- delivered_at and gave_up_at say how it went. id is what the receiver sees, to drop a repeat (a crash
-- between the POST and its record here sends it again).
--
-- The scope (migration 020) is in the key, as in every table of effects, so it could be sharded with
-- them. Rows of effects no longer open are deleted a retention after their delivery ended.
--
-- Cost: nothing until a webhook is configured; then a row per wait told of, a few hundred bytes.

create table if not exists effect_notifications (
    scope        uuid        not null,
    effect_id    bigint      not null,
    event        text        not null check (event in ('needs_review', 'in_doubt')),
    -- The effect's attempt when the wait was noticed: a new wait of the effect has a later one.
    attempt      integer     not null,
    id           uuid        not null default gen_random_uuid(),
    -- What the notification says of the effect, as it was when noticed: the audit row may be archived
    -- with its month before a receiver that is down comes back.
    state        text        not null,
    tenant       text        not null,
    upstream     text        not null,
    method       text        not null,
    path         text        not null,
    created_at   timestamptz not null,
    run_id       text,
    step         text,
    -- When the wait began: when the effect's latest attempt ended (its answer came, or its lease ran out).
    waiting_since timestamptz not null,
    noticed_at   timestamptz not null default now(),
    tries        integer     not null default 0,
    next_try_at  timestamptz not null default now(),
    last_try_at  timestamptz,
    last_status  integer,
    last_error   text,
    delivered_at timestamptz,
    gave_up_at   timestamptz,
    primary key (effect_id, event, attempt, scope)
);

-- The deliveries due, in the order they fall due: the only ones a worker looks for.
create index if not exists effect_notifications_due on effect_notifications (next_try_at)
    where delivered_at is null and gave_up_at is null;
