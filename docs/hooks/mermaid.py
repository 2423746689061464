"""Mermaid served with the site, so that its diagrams draw offline.

Material for MkDocs loads Mermaid from a CDN when a page holds a diagram, unless the page already defines
``mermaid``. This hook puts a pinned Mermaid (``VERSION``, the npm registry's tarball, checked against its sha512
``INTEGRITY``) into the site at ``SCRIPT`` and onto every page (``extra_javascript``), so the CDN is never asked.
The tarball is fetched once per machine into ``.cache/docs/`` (the build's only download, from a package registry).
"""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import urllib.request
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

from shared.files import atomic_write_bytes

VERSION = "11.17.2"  # Material's bundle asks for mermaid@11
TARBALL = f"https://registry.npmjs.org/mermaid/-/mermaid-{VERSION}.tgz"
INTEGRITY = "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
MEMBER = "package/dist/mermaid.min.js"
SCRIPT = "assets/javascripts/mermaid.min.js"
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "docs" / f"mermaid-{VERSION}.min.js"


def mermaid_script(cache: Path = CACHE, fetch=lambda url: urllib.request.urlopen(url, timeout=60).read()) -> Path:
    """The pinned ``mermaid.min.js``, fetched and checked on the first call on a machine → its path in ``cache``."""
    if cache.is_file():
        return cache
    tarball = fetch(TARBALL)
    algorithm, _, expected = INTEGRITY.partition("-")
    got = base64.b64encode(hashlib.new(algorithm, tarball).digest()).decode()
    if got != expected:
        raise RuntimeError(f"{TARBALL}: {algorithm} is {got}, not the pinned {expected}")
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        script = archive.extractfile(MEMBER).read()
    return atomic_write_bytes(cache, script, mode=0o644)


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    if SCRIPT not in [str(script) for script in config.extra_javascript]:
        config.extra_javascript.insert(0, SCRIPT)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, SCRIPT, abs_src_path=str(mermaid_script())))
    return files
