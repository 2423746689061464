"""The server's state layer for work: the one place that writes ``Job.status`` and a federated job's
``Round.status`` and ``RoundClient.status``, as small database transitions shared by the routes, the compile queue
and the sweepers (``tests/server/test_structure.py`` keeps it so). With ``server.accounts`` (users, devices, models,
cohorts) it is everything in ``server/`` that writes. One module per subsystem:

- ``jobs``: a job's life from submit through compile to ready, failure and cancel; which jobs fit a device;
- ``leases``: a device's work under its lease: leased, kept alive, expired, ended by a result or a failure,
  released when the device is revoked;
- ``sessions``: a standing job's sessions and the promotion rule;
- ``rounds``: a federated job's rounds and each client's part in one;
- ``closes``: a round's close, and its reopening or failure at the timeout;
- ``programs``: compiled programs' rows and the merged downloads kept on disk.

Transaction rule (``server.accounts``'s too): a transition is one unit of work, which its function opens
(``server.db.begin_write``: the session's read ends, a write transaction begins) and commits, so a route's write is
all or nothing and nothing else in ``server/`` commits. Where a write depends on what was read (a lease, a round
part), the reads are inside the unit. The few functions that are a step of a larger transaction say "the caller
commits" and join their caller's unit: ``succeed`` and ``end_session`` in ``accept_result`` (with the adapter
version), ``expire_leases``, ``lease_next`` and ``lease_session`` in ``lease``, the round work of
``take_round_part`` (``open_first_round``, ``lease_round_client``), ``expire_round_clients`` in the sweep, and a
compiled program's ``program_row`` (``tests/server/test_structure.py`` holds every writer here to it).

Transitions that race (a heartbeat against the sweeper, a result against a cancel) are conditional UPDATEs
checked by their row count, which is safe on SQLite and on PostgreSQL alike; leasing locks the row it takes.
"""
