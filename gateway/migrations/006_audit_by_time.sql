-- The audit's filter by a span of time (since and until) reads the effects of that span, not the newer ones.
--
-- Pages of the audit come newest first, in id order. With only since, the newest effects are in the span
-- and the primary key yields them at once. With until too, the primary key has to step over every
-- effect created after the span before it reaches one inside it: a span a month back read most of a
-- month. This index gives the ids of the span itself (an index-only scan), from which the page's newest
-- are picked.

create index effects_created on effects (created_at, id);
