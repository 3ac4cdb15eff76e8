-- A body may be kept deflated (gateway.packing): "coding" says how, '' for the bytes as they were.
--
-- Every body stored before this migration is as it was, and the constant default makes adding the
-- column a change of the catalog alone: no partition is rewritten or read, however many rows it holds.
-- The gateway checks the values it reads (a validated CHECK constraint would read every row).

alter table effect_bodies add column coding text not null default '';
