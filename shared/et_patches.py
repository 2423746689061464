"""The patches of ExecuTorch's and torch's internals that the export pipeline (``shared.lowering``) applies while it
lowers, in one place: each replaces a private attribute for the length of a ``with`` block and puts it back after.

Every ExecuTorch or torch upgrade means re-deriving them, so they are written against one pair of versions
(``PATCHED_FOR``, the pins of ``pyproject.toml``):

- ``less_bookkeeping`` (speed, no byte of the program changes): applied only on those versions. On others it
  applies nothing and says so once in the log: the export is then slower, never different.
- ``subclass_weights_as_params`` (needed: XNNPACK takes no 8da4w weight without it): applied on any version; where
  the attribute it replaces is gone it fails loudly, naming this module.

What each waits for upstream: XNNPACK preprocessing every partition with every pass, whether the partition holds the
pass's ops or not, is the cost ExecuTorch's own lowering hack of pytorch/executorch#1893 names ("allow partitioner to
highlight what was partitioned so we don't run unrelated transform passes"); the deep copy of every partition's
program before preprocessing is what pytorch/executorch#4311 ("Retire deep copy of edge_program in to_backend",
closed unmerged) would remove. The other costs (provenance copied per node and pass, graph code regenerated per
partition, the ATen-to-edge and dim-order passes re-tracing methods they leave unchanged, a weight's bytes held once
per method) have no upstream issue filed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Iterator
from importlib.metadata import version

import torch

log = logging.getLogger(__name__)

# The versions the patches were derived against: the project's pins.
PATCHED_FOR = {"executorch": "1.5.1", "torch": "2.13.0"}


def installed_versions() -> dict[str, str]:
    """The installed versions of the packages the patches reach into (``+cpu`` and other local tags dropped)."""
    return {package: version(package).split("+")[0] for package in PATCHED_FOR}


@functools.cache
def _warned_once(installed: tuple) -> None:
    log.warning(
        "ExecuTorch/torch %s, not the %s the export's speed patches were written for: exporting without them "
        "(slower, the same program)",
        dict(installed),
        PATCHED_FOR,
    )


@contextlib.contextmanager
def less_bookkeeping(versions: Callable[[], dict[str, str]] = installed_versions) -> Iterator[None]:
    """``_less_bookkeeping`` on the versions of ``PATCHED_FOR``; nothing (logged once) on others."""
    installed = versions()
    if installed != PATCHED_FOR:
        _warned_once(tuple(sorted(installed.items())))
        yield
        return
    with _less_bookkeeping():
        yield


def _xnnpack_pass_triggers() -> dict[type, Callable[[set], bool]]:
    """XNNPACK's preprocessing passes that act only on ops of their own, each with the test of whether a graph holds
    one (``targets``: the graph's call_function targets). Each of these passes looks for its ops, rewrites them, and
    then re-traces the whole graph with fake tensors whether it found any or not: for a partition without them the
    re-trace is the pass's only work, and it changes nothing. A pattern pass (SDPA, bilinear upsampling) can match
    only where every op of one of its patterns is present. The passes not listed here (clone and dim-order removal,
    constant propagation, the pad and memory-format passes) always run."""
    from executorch.backends.transforms.remove_getitem_op import RemoveGetItemPass
    from executorch.backends.xnnpack._passes import (
        Conv1dUnsqueezePass,
        ConvertToLinearPass,
        ConvertToSDPAPass,
        ConvertToUpsampleBilinear2d,
        DecomposeBatchNorm,
        DecomposeConcatenate,
        FuseActivationPass,
        FuseBatchNormPass,
        PReLUReshapePass,
        PropagateCustomMetaPass,
        RemoveRedundantCopyPass,
    )
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa
    from executorch.backends.xnnpack.utils.quant_utils import _DQ_OPS, _Q_OPS
    from executorch.exir.backend.canonical_partitioners.config_partitioner import format_target_name
    from executorch.exir.dialects._ops import ops as exir_ops

    edge = exir_ops.edge.aten

    def any_of(*ops):
        return lambda targets: not targets.isdisjoint(ops)

    def any_pattern(patterns):
        needed = [{n.target for n in p.graph.nodes if n.op == "call_function"} for p in patterns]
        return lambda targets: any(ops <= targets for ops in needed)

    def quantized(targets):  # quant_utils.is_quant / is_dequant, by target
        return any(format_target_name(t.__name__) in _Q_OPS | _DQ_OPS for t in targets)

    batch_norm = any_of(*DecomposeBatchNorm.BATCH_NORM_OPS)
    return {
        ConvertToUpsampleBilinear2d: any_pattern(bilinear_2d.get_graphs_dict()),
        ConvertToLinearPass: any_of(*ConvertToLinearPass.targets),
        PropagateCustomMetaPass: quantized,
        ConvertToSDPAPass: any_pattern(sdpa.get_graphs()),
        FuseBatchNormPass: batch_norm,
        DecomposeBatchNorm: batch_norm,
        FuseActivationPass: any_of(*FuseActivationPass.FUSEABLE_ACTIVATIONS),
        DecomposeConcatenate: any_of(edge.cat.default),
        RemoveGetItemPass: any_of(edge.max_pool2d_with_indices.default, edge.max.dim),
        Conv1dUnsqueezePass: any_of(edge.convolution.default),
        PReLUReshapePass: any_of(edge._prelu_kernel.default),
        RemoveRedundantCopyPass: any_of(edge._to_copy.default),
    }


def _edge_pass_triggers() -> dict[type, Callable[[torch.fx.GraphModule], bool]]:
    """Passes of ExecuTorch's ATen-to-edge stage that change a graph only where it holds what they rewrite, each with
    that test; like XNNPACK's (``_xnnpack_pass_triggers``) each re-traces the whole method with fake tensors whether
    it rewrites anything or not (the tiny training program's forward: about a quarter of its edge passes' time). The
    tests restate each pass's own condition: ``aten.t`` (``NormalizeTransposePass``), an aliasing view op
    (``ReplaceBrokenOpsWithFunctionalOpsPass``), a symbolic scalar passed where the op's schema takes a tensor
    (``SymToTensorPass``). A graph with submodules (control flow) runs them all."""
    from executorch.exir.passes import ReplaceBrokenOpsWithFunctionalOpsPass
    from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
    from executorch.exir.passes.sym_to_tensor_pass import SymToTensorPass

    def calls(gm):
        return [n for n in gm.graph.nodes if n.op == "call_function"]

    def transpose(gm) -> bool:
        return any(n.target == torch.ops.aten.t.default for n in calls(gm))

    def view(gm) -> bool:
        return any(getattr(n.target, "is_view", False) for n in calls(gm))

    def symbolic_tensor_argument(gm) -> bool:
        symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
        for node in calls(gm):
            schema = getattr(node.target, "_schema", None)
            if schema is None:
                continue
            for i, arg in enumerate(schema.arguments):
                value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if (
                    isinstance(arg.type, torch.TensorType)
                    and isinstance(value, torch.fx.Node)
                    and isinstance(value.meta.get("val"), symbolic)
                ):
                    return True
        return False

    return {
        NormalizeTransposePass: transpose,
        ReplaceBrokenOpsWithFunctionalOpsPass: view,
        SymToTensorPass: symbolic_tensor_argument,
    }


def _emit_pass_triggers() -> dict[type, Callable[[torch.fx.GraphModule], bool]]:
    """Passes of ExecuTorch's edge-to-ExecuTorch stage that change a graph only where it holds what they rewrite,
    each with that test: ``LegalizePortableDimOrderPass`` re-traces the whole method with fake tensors (half of an
    8da4w SmolLM2 program's emit stage) to put a contiguous copy before a portable pooling, ``expand_copy``, ``mean``
    or ``sum`` whose input is not in the default dim order; the project's graphs hold such ops, never on such an
    input. An input whose traced value is unknown runs the pass."""
    from executorch.exir.passes.legalize_portable_dim_order_pass import LegalizePortableDimOrderPass

    def non_default_dim_order_input(gm) -> bool:
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target not in LegalizePortableDimOrderPass._target_ops:
                continue
            value = node.args[0] if node.args else None
            value = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
            if value is None:
                return True
            if isinstance(value, torch.Tensor) and tuple(value.dim_order()) != tuple(range(value.dim())):
                return True
        return False

    return {LegalizePortableDimOrderPass: non_default_dim_order_input}


def _needed_edge_passes(passes: list, triggers: dict) -> list:
    """``passes`` (ExecuTorch's: an edge stage's, each wrapped to return a PassResult, or the emit stage's own pass
    objects) with those of ``triggers`` skipped on a graph they would leave as it is."""
    from torch.fx.passes.infra.pass_base import PassResult

    def when_needed(wrapped, needed):
        def run(gm):
            has_submodules = any(isinstance(m, torch.fx.GraphModule) for m in gm.children())
            return wrapped(gm) if has_submodules or needed(gm) else PassResult(gm, False)

        return run

    out = []
    for wrapped in passes:
        needed = triggers.get(type(getattr(wrapped, "__wrapped__", wrapped)))
        out.append(wrapped if needed is None else when_needed(wrapped, needed))
    return out


@contextlib.contextmanager
def _less_bookkeeping() -> Iterator[None]:
    """Eight costs of the edge stages that grow with the graph and the partitions, removed without changing a byte
    of the program (``benchmarks/export_time.py`` compares the bytes with and without them):

    - graph modules the edge stages build are lazy (what ``torch.compile`` uses): their Python code is generated once,
      when first needed, not after every change. XNNPACK's pattern graphs are exported before, outside the lazy mode
      (strict export needs eager modules).
    - every pass deep-copies each node's whole provenance chain (``NodeSource.from_node``) into the new node: a
      tenth of the export. The chain's entries are never changed once made, so the new entry shares them.
    - XNNPACK preprocesses each partition with 17 passes, most of which re-trace the partition even where it holds
      none of their ops (``_xnnpack_pass_triggers``): those are skipped.
    - the ATen-to-edge stage re-traces each method once per pass, three of which rewrite ops the project's graphs
      do not hold (``_edge_pass_triggers``): those are skipped where a method holds none.
    - the edge-to-ExecuTorch stage re-traces each method for a dim-order pass with nothing to rewrite in the
      project's graphs (``_emit_pass_triggers``): skipped where a method gives it nothing.
    - the method partitions are carved out of is an eager graph module all the same, and carving each partition
      re-sorts the method (``legalize_graph`` sets ``GraphModule.graph``), which regenerated its whole code:
      SmolLM2's 339 partitions of ``forward``, a fifth of its export. The code is generated once, after the last.
    - XNNPACK copies each weight it takes into a ``bytes`` object for its partition's named-data store, so a weight
      that several methods use (``forward`` and ``evaluate`` share the whole base) was held once per method until
      the program was written. A store is handed the object already held for the same key and content instead.
    - before preprocessing a partition, ExecuTorch deep-copies its program, weights included, in case the backend
      changes it; the copies of every partition of every method are made before the first is preprocessed
      (SmolLM2: two copies of the base, 1 GB). XNNPACK's preprocessing replaces constants, never writes into them, so
      the copy shares the constant tensors (ExecuTorch's CUDA backend does the same in its low-memory mode); the
      graph and the state dict's mapping are still copied.

    The settings are process-wide while a lowering runs: the server exports in worker processes of their own, one
    export each (``server.pool``).
    """
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir.backend import backend_api
    from executorch.exir.program import _program
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    from torch.fx.traceback import NodeSource

    triggers = _xnnpack_pass_triggers()
    edge_triggers = _edge_pass_triggers()
    emit_triggers = _emit_pass_triggers()
    edge_passes = _program._get_aten_to_edge_passes
    emit_passes = _program.edge_to_executorch_passes
    make_source = NodeSource.__init__
    run_passes = XNNPACKPassManager.transform
    carve = backend_api._create_partitions_in_graph_module
    add_named_data = NamedDataStore.add_named_data
    held: dict[str, bytes] = {}  # key -> the first bytes object stored under it during this lowering

    def add_once(self, key, data, *args, **kwargs):
        """Store ``data`` as the object already held for ``key`` where the contents are equal."""
        if isinstance(data, bytes):
            first = held.setdefault(key, data)
            if first is not data and first == data:
                data = first
        return add_named_data(self, key, data, *args, **kwargs)

    copy_for_preprocess = XnnpackBackend.__dict__.get("copy_exported_program_for_preprocess")

    def copy_sharing_constants(cls, program, compile_specs):
        """``program`` deep-copied but for its constant tensors, which the copy shares."""
        constants = (*program.state_dict.values(), *program.constants.values())
        return copy.deepcopy(program, {id(t): t for t in constants if isinstance(t, torch.Tensor)})

    def carve_then_compile(method, *args, **kwargs):
        """Carve every partition out of ``method``, then generate its code once (not after each partition)."""
        method.recompile = lambda: None  # shadows GraphModule.recompile on this instance while carving
        try:
            return carve(method, *args, **kwargs)
        finally:
            del method.recompile
            method.recompile()

    def share_history(self, node=None, pass_name="", action=None):
        history = node.meta.pop("from_node", None) if node is not None else None
        try:
            make_source(self, node, pass_name, action)  # with no history to copy
        finally:
            if history is not None:
                node.meta["from_node"] = history
                self.from_node = list(history)

    def needed_passes_only(self):
        everything = self.passes
        ep = self.exported_program
        for pass_ in everything:
            targets = {node.target for node in ep.graph.nodes if node.op == "call_function"}
            if pass_ in triggers and not triggers[pass_](targets):
                continue
            self.passes, self._exported_program = [pass_], ep
            try:
                ep = run_passes(self)
            finally:
                self.passes = everything
        return ep

    def needed_edge_passes(config):
        pre, post = edge_passes(config)
        return _needed_edge_passes(pre, edge_triggers), post

    def needed_emit_passes(*args, **kwargs):
        return _needed_edge_passes(emit_passes(*args, **kwargs), emit_triggers)

    NodeSource.__init__ = share_history
    XNNPACKPassManager.transform = needed_passes_only
    backend_api._create_partitions_in_graph_module = carve_then_compile
    _program._get_aten_to_edge_passes = needed_edge_passes
    _program.edge_to_executorch_passes = needed_emit_passes
    NamedDataStore.add_named_data = add_once
    XnnpackBackend.copy_exported_program_for_preprocess = classmethod(copy_sharing_constants)
    try:
        with _use_lazy_graph_module(True):
            yield
    finally:
        NodeSource.__init__ = make_source
        XNNPACKPassManager.transform = run_passes
        backend_api._create_partitions_in_graph_module = carve
        _program._get_aten_to_edge_passes = edge_passes
        _program.edge_to_executorch_passes = emit_passes
        NamedDataStore.add_named_data = add_named_data
        if copy_for_preprocess is None:  # inherited from BackendDetails: drop the override
            del XnnpackBackend.copy_exported_program_for_preprocess
        else:
            XnnpackBackend.copy_exported_program_for_preprocess = copy_for_preprocess


@contextlib.contextmanager
def subclass_weights_as_params() -> Iterator[None]:
    """While this runs, XNNPACK's GEMM check takes an inner tensor of a constant tensor subclass (torchao's quantized
    weight: ``access_subclass_inner_tensor(weight, "qdata")``) for the parameter it becomes when the method is
    functionalized; everything else it checks as before."""
    from executorch.backends.xnnpack.partition.config import gemm_configs

    is_param_node = gemm_configs.is_param_node

    def param_once_functional(ep, node) -> bool:
        inner = torch.ops.export.access_subclass_inner_tensor.default
        if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == inner:
            return is_param_node(ep, node.args[0])
        return is_param_node(ep, node)

    gemm_configs.is_param_node = param_once_functional
    try:
        yield
    finally:
        gemm_configs.is_param_node = is_param_node
