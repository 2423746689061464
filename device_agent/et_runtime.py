"""The ExecuTorch runtime (``executorch.runtime.Runtime``), imported without the exporter.

ExecuTorch's pybindings import ``executorch.exir._warnings`` for one decorator, and importing that module first runs
``executorch/exir/__init__.py``, which loads the whole exporter (torch.export, dynamo, inductor's pattern matcher):
5.4 of the 6.5 s that ``import executorch.runtime`` took on a 2-core x86 VM, paid by every agent process before
its first step. A device only runs programs, so here that one module is loaded by itself while the runtime imports;
``executorch.exir`` is left unimported, and a later ``import executorch.exir`` in the same process (an export)
loads it whole as usual.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

_EXIR = "executorch.exir"
_WARNINGS = "executorch.exir._warnings"


def runtime():
    """``executorch.runtime.Runtime.get()``, its module imported without ``executorch.exir`` where it is not
    imported yet."""
    if "executorch.runtime" not in sys.modules and _EXIR not in sys.modules:
        _import_runtime_alone()
    from executorch.runtime import Runtime

    return Runtime.get()


def _import_runtime_alone() -> None:
    import executorch

    package = next(Path(p) / "exir" for p in executorch.__path__ if (Path(p) / "exir" / "_warnings.py").is_file())
    spec = importlib.util.spec_from_file_location(_WARNINGS, package / "_warnings.py")
    warnings_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(warnings_module)
    placeholder = types.ModuleType(_EXIR)  # stands for the package while the runtime imports, then goes
    placeholder.__path__ = [str(package)]
    placeholder._warnings = warnings_module
    sys.modules[_EXIR], sys.modules[_WARNINGS] = placeholder, warnings_module
    try:
        import executorch.runtime  # noqa: F401
    finally:
        del sys.modules[_EXIR]
        if getattr(executorch, "exir", None) is placeholder:
            del executorch.exir
        leaked = sorted(name for name in sys.modules if name.startswith(_EXIR + ".") and name != _WARNINGS)
        for name in leaked:  # submodules imported through the placeholder would belong to no real package
            del sys.modules[name]
