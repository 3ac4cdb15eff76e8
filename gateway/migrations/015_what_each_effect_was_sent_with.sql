-- What each effect was sent with, so that recovery relies on it and not on today's settings.
--
-- Recovery judged an attempt in doubt by the upstream's configuration as it is now. Once an operator
-- changed it, that could send an effect twice: a native key added after the first send made the gateway
-- re-send under a header the first request never carried (the upstream could not tell it was the same
-- effect); a stamp moved to another field sent the probe looking where the first request was never
-- stamped; a timeout shortened while an effect was in doubt made the probe's lag count from a lease
-- shorter than the one the attempt was given, so a "not found" was trusted before the search could list
-- what the attempt did.
--
-- key_carriers: what carried the derived key in every attempt that may have reached the upstream, in the
-- configuration's words ({"native_key": "Idempotency-Key", "stamp": {"json_field": "client_reference"}},
-- {} for nothing); written by the claim and by each take-over that sends. send_lease: the lease the
-- latest attempt that sent was given. Both are null on the rows claimed before this migration, which
-- recorded neither: recovery then trusts neither the native key nor the probe for them, and an effect
-- of theirs that may have happened waits for an operator.
--
-- Nullable columns without a default: adding them to the partitioned table changes the catalog alone,
-- on Postgres 15 as on later versions, and rewrites no partition. "if not exists": run again over a
-- schema that has them (its version row deleted by hand), it changes nothing.

alter table effects
    add column if not exists key_carriers jsonb,
    add column if not exists send_lease interval;
