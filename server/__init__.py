"""The mobizo REST server: users, devices, jobs, program compilation and the adapter registry."""
