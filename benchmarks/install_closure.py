"""What an install of a requirement holds: the closure of ``NAME[EXTRAS]``'s requirements among the distributions
installed in this interpreter's environment (markers and extras evaluated here, requirements walked recursively,
a distribution's extras as its requirers name them), and the files their ``RECORD`` lists, counted and summed once
each. A folder's own size (``folder_size``) counts what ``RECORD`` does not: bytecode written at import, the
installer's own packages.

Standard library and ``packaging`` only (pip's copy where the environment has none), so that another interpreter
(a device's venv, an emulated device's) runs the same code on its own packages: ``device_footprint`` passes this
file's source as ``python -I -c SOURCE NAME[EXTRAS]...``, which prints one JSON object per requirement.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # an environment without packaging of its own: pip's copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def installed(path: list[str] | None = None) -> dict[str, metadata.Distribution]:
    """The distributions on ``path`` (default ``sys.path``: this environment's) by normalized name, the first of a
    name where two are (the one ``import`` sees)."""
    dists: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=sys.path if path is None else path):
        dists.setdefault(canonicalize_name(dist.metadata["Name"]), dist)
    return dists


def closure(requirement: str, dists: dict[str, metadata.Distribution] | None = None) -> dict:
    """The distributions ``requirement`` (``NAME[EXTRAS]``) brings in this environment, their files and bytes.

    Each (distribution, extra) is expanded once: its base requirements (extra ``""``) and those whose marker holds
    for the extra; a requirement that holds brings its distribution with the extras it names. Versions are not
    checked (what is installed is what is measured); a required distribution not installed is listed in
    ``missing``. A file listed by two distributions counts once."""
    dists = installed() if dists is None else dists
    start = Requirement(requirement)
    todo = [(canonicalize_name(start.name), extra) for extra in ("", *sorted(start.extras))]
    expanded: set[tuple[str, str]] = set()
    missing: set[str] = set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in expanded:
            continue
        expanded.add((name, extra))
        dist = dists.get(name)
        if dist is None:
            missing.add(name)
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            if req.marker is None and extra:
                continue  # a base requirement: the "" pass took it
            todo += [(canonicalize_name(req.name), e) for e in ("", *sorted(req.extras))]
    seen: set[Path] = set()
    rows = []
    for name in sorted({name for name, _ in expanded} - missing):
        dist = dists[name]
        files = size = 0
        for entry in dist.files or []:
            path = Path(os.path.realpath(dist.locate_file(entry)))
            if path in seen or not path.is_file():
                continue
            seen.add(path)
            files += 1
            size += path.stat().st_size
        rows.append({"name": name, "version": dist.version, "files": files, "bytes": size})
    return {
        "requirement": requirement,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "prefix": sys.prefix,
        "distributions": rows,
        "missing": sorted(missing),
        "files": sum(r["files"] for r in rows),
        "bytes": sum(r["bytes"] for r in rows),
    }


def folder_size(folder: Path) -> tuple[int, int]:
    """(regular files, their bytes) under ``folder``; links not followed, a file linked twice counted once."""
    seen: set[tuple[int, int]] = set()
    files = size = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            st = os.lstat(os.path.join(parent, name))
            if (st.st_mode & 0o170000) != 0o100000 or (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            files += 1
            size += st.st_size
    return files, size


if __name__ == "__main__":
    print(json.dumps([closure(requirement) for requirement in sys.argv[1:]]))
