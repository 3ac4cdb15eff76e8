-- A gateway from before 009 reads effect_bodies.body as the bytes as sent and writes bodies without
-- their coding. Beside a newer one (a rolling upgrade, or a rollback past 009) it would replay a deflated
-- body to an agent as if it were the upstream's answer, and its retention would carry deflated bodies
-- forward marked ''. Renaming the column makes every statement of such a gateway that touches a body
-- fail instead: it answers an error and sends nothing, corrupting nothing. Dropping the default does the
-- same for any other insert that leaves the coding out. Both change the catalog alone: the rows stored
-- before 009 keep '' (Postgres keeps the value a column was added with for the rows it already had).

alter table effect_bodies rename column body to content;
alter table effect_bodies alter column coding drop default;
