-- Response headers as the upstream sent them, as bytes: a value that is not UTF-8 (obs-text, such as
-- "caf\xe9") cannot live in jsonb, and an answer that cannot be stored was being re-sent. The block is
-- "Name: value" lines joined by CRLF, which no header name or value can contain.
alter table effects add column response_head bytea;
update effects set response_head = (
    select convert_to(coalesce(string_agg(pair ->> 0 || ': ' || (pair ->> 1), E'\r\n' order by n), ''), 'UTF8')
    from jsonb_array_elements(response_headers) with ordinality as h(pair, n)
) where response_headers is not null;
alter table effects drop column response_headers;
alter table effects rename column response_head to response_headers;

-- Requests sent without an Idempotency-Key under the upstream's "audit" policy: a row for the audit,
-- never looked up by key (its key is made up) and never replayed.
alter table effects add column keyless boolean not null default false;

-- The secret of the keyed MAC that derives the keys upstreams receive, so that one tenant cannot compute
-- another's. Made here once, shared by every gateway on the database; gen_random_uuid() draws from
-- pg_strong_random (two of them: 244 random bits).
create table effect_gateway_secrets (
    name  text primary key,
    value bytea not null
);
insert into effect_gateway_secrets (name, value)
values ('derived_keys', decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'));
