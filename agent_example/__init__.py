"""The grocery agent of six steps, the demo upstreams it calls, and the crash matrix that kills it.

`effect-gateway demo` runs the crash matrix (crash_matrix.py): the agent (agent.py), in each of its five
designs, is killed with SIGKILL after a side effect and after a checkpoint, then run again to the end;
the effects the demo shop and mail services (upstreams/) received are counted, so the table shows
which designs do a side effect twice.
"""
