"""The server's bounded caches (``shared.lru.LRUCache``, least recently used out).

For what never changes once written, so that nothing needs invalidating: a device's token hash and user (fixed at
enrollment; devices are never re-keyed or deleted) and a compiled program's manifest (a program row is written once
and never deleted). Each API process keeps its own; a miss reads the database.
"""

from __future__ import annotations

from shared.lru import LRUCache as LRUCache
