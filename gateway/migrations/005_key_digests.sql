-- effect_keys by a digest of the key instead of its text: the table a third smaller, its index 40%.
--
-- Agents' keys are random, so each new key goes into a random leaf of the key table's unique index; after
-- every checkpoint the first change to a leaf writes the whole page to the WAL. Once the index is far
-- larger than the keys that arrive between two checkpoints, nearly every new effect pays one such page
-- image: the WAL of a new effect grows with the index. A 16-byte digest in place of the key (up to 255
-- characters, 36 for a UUID) makes each entry 36 bytes instead of about 60, so the same keys fill fewer
-- pages, and fewer of them are written whole.
--
-- The digest is the first 16 bytes of SHA-256 of the key: no two keys of a tenant and upstream share one
-- by chance (a collision is expected after about 2^64 keys), and finding two that do is not feasible.
-- The store checks the key of the audit row it finds anyway. The digest leads the key, so the audit's
-- filter by key alone (any tenant, any upstream) is a range of this index.

create function effect_key_digest(key text) returns uuid
language sql immutable strict parallel safe
as $$ select encode(substring(sha256(convert_to(key, 'UTF8')) from 1 for 16), 'hex')::uuid $$;

alter table effect_keys rename to effect_keys_v1;
alter table effect_keys_v1 rename constraint effect_keys_pkey to effect_keys_v1_pkey;

create table effect_keys (
    digest     uuid        not null,
    tenant     text        not null,
    upstream   text        not null,
    effect_id  bigint      not null,
    created_at timestamptz not null,
    primary key (digest, tenant, upstream)
);

insert into effect_keys (digest, tenant, upstream, effect_id, created_at)
select effect_key_digest(key), tenant, upstream, effect_id, created_at from effect_keys_v1;

drop table effect_keys_v1;
