-- A tenant's and an upstream's pages of the audit read their own effects, however few they are.
--
-- A page of a span was read down effects_created (created_at, id), and a tenant's or an upstream's
-- filter thrown over every other effect of the span: a tenant with ten effects beside another's
-- 300,000 read the 300,000 for an empty page. The indexes on (tenant, id) and (upstream, id) become
-- (tenant, created_at, id) and (upstream, created_at, id), and their pages go by creation time like a
-- span's, so each is a range of its index with or without a span. The number of indexes a new effect
-- writes stays the same.
--
-- A plain create index (migrations run in a transaction) blocks writes to the audit while it is
-- built, about two seconds per million effects for the two (0.6 s for 300,000); on a large audit, run
-- "effect-gateway migrate" in a maintenance window.

drop index effects_tenant, effects_upstream;
create index effects_tenant on effects (tenant, created_at, id);
create index effects_upstream on effects (upstream, created_at, id);
