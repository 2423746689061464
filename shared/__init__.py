"""The MobiZO core shared by the server and the device agent: noise, MP-LoRA, the ZO step, tasks, files.

Nothing in here imports from ``server`` or ``device_agent``.
"""
