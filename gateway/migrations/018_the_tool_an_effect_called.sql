-- The MCP tool an effect called, for the audit and for recovery.
--
-- An MCP server takes every tool call at one endpoint, so the method and path of its effects are the
-- same whatever the tool: "place_order" and "send_email" both POST /mcp. Recovery must know which tool
-- an effect called, because a probe finds the effects of the tools it searches and no others (asked
-- about an email, a search of orders finds nothing, and "not found" would send the email again); the
-- audit shows it as it shows the route. Null for an HTTP effect.
--
-- A nullable column without a default: adding it to the partitioned table changes the catalog alone, on
-- Postgres 15 as on later versions, and rewrites no partition. A gateway from before it runs on beside
-- one after it; the MCP upstreams it does not know it refuses to start with.

alter table effects add column if not exists tool text;
