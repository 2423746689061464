"""The one export pipeline of every ExecuTorch program the project builds: a training step (``shared.program``),
the inference program (``shared.inference_program``), the first-order peer (``shared.fo_program``, traced forward
and backward) and the benchmarks' plain forward.

    trace   torch.export each method (``Methods``: its example inputs and dynamic shapes) through ``MethodModule``
            and mark the frozen constants (base weights, A) for the external ``.ptd`` (``weights_tag``)
    to_edge to_edge_transform_and_lower: XNNPACK takes the frozen matmuls, the rest stays in portable kernels
    emit    to_executorch: memory planning (mutable buffers shared by the methods), buffers to zero
    store   the ``.pte`` written atomically; the ``.ptd`` and the tokenizer content-addressed, shared by every
            program of the model

``lower`` runs the first three. ``benchmarks/export_time.py`` times each stage. Before them, every exporter starts
the same way (``start_export``: the model and its tokenizer loaded, the store folder made, the clock started).

A program kind differs only in its module, its methods and which tensors stay out of the ``.ptd``: everything else
is this module's. ``Emitted.planned`` is what the emitted program's memory plan reserves per method (its mutable
and activation buffers), read from the program itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shared import memory
from shared.et_patches import less_bookkeeping, subclass_weights_as_params
from shared.layers import ROTATION
from shared.manifest import ProgramFile
from shared.processes import die_with_parent
from shared.ptd import WEIGHTS_TAG, store_weights

# method name -> (example inputs, dynamic shapes of those inputs or None)
log = logging.getLogger(__name__)
Methods = dict[str, tuple[tuple, Any]]
WeightsTag = Callable[[torch.fx.Node], str | None]


class MethodModule(nn.Module):
    """Exposes one method of a program module as ``forward`` so that torch.export can trace it.

    Every method is traced through the same attribute name (``program``), so a mutable buffer (B, a KV cache) has
    the same name in all of them and ``share_mutable_buffers`` gives them one allocation.
    """

    def __init__(self, program: nn.Module, method: str) -> None:
        super().__init__()
        self.program = program
        self.method = method

    def forward(self, *args):
        return getattr(self.program, self.method)(*args)


def is_frozen_weight(node: torch.fx.Node) -> bool:
    """What goes to the shared .ptd: the base model's constants, and nothing a job's configuration decides.

    The mutable B and optimizer state have no value in any file (the device sets them before step 1). The frozen A
    stays in the .pte (each method that uses it carries its copy: SmolLM2, rank 4: 2 x 0.55 MB): A depends on the
    job's rank, targets and A seed, and in the .ptd it would make programs of two ranks keep two copies of the base
    on a device. The classification objective's candidate ids and a calibrated program's prior stay in the .pte too:
    they are the task's, and the .ptd the model's. So does the attention's rotation (``shared.layers``: a 64 x 64
    constant of the training programs, which inference programs, sharing the .ptd, do not use).
    """
    # Lower case: a get_attr's target keeps the attribute's case (``lora_A``), a lifted constant's placeholder name
    # does not (``b_model_…_lora_a``), and both name A in the stages that tag (``lower``).
    name = str(node.target if node.op == "get_attr" else node.name).lower()
    return not any(
        part in name for part in ("lora_b", "lora_a", "candidate_ids", "candidate_prior", "opt_state", ROTATION)
    )


def frozen_weights_tag(node: torch.fx.Node) -> str | None:
    """The training programs' rule: every frozen constant goes to the .ptd."""
    return WEIGHTS_TAG if is_frozen_weight(node) else None


def _frozen_inputs(exported) -> set[str]:
    """The placeholders of an exported program that hold constants (parameters, buffers it does not mutate, lifted
    tensors): user inputs and mutated buffers (B, an optimizer's state) are never frozen."""
    sig = exported.graph_signature
    mutated = set(sig.buffers_to_mutate.values())
    buffers = {name for name, target in sig.inputs_to_buffers.items() if target not in mutated}
    return set(sig.inputs_to_parameters) | buffers | set(sig.inputs_to_lifted_tensor_constants)


def tag_frozen(exported, weights_tag: WeightsTag, tag_computed: bool) -> None:
    """Tag, on the exported program itself, what XNNPACK serializes to the .ptd: the frozen constants
    (``weights_tag``) and, with ``tag_computed``, every node computed from frozen nodes only. XNNPACK reads the tag
    on the node that feeds the linear: for a quantized weight that is the ``dequantize_affine`` of (int weight,
    scales, zero points), not the constant — without the second rule the 4-bit weights and their scales land in the
    .pte (SmolLM2: 64 MB). Float32 programs tag the constants alone: computed values depend on the program's graph,
    and tagging them would give each program its own .ptd instead of the model's shared one.
    """
    constants = _frozen_inputs(exported)
    frozen: set[torch.fx.Node] = set()
    for node in exported.graph.nodes:
        if node.op == "placeholder":
            tagged = node.name in constants and weights_tag(node)
        else:
            tagged = (
                tag_computed
                and node.op == "call_function"
                and bool(node.all_input_nodes)
                and all(n in frozen for n in node.all_input_nodes)
            )
        if tagged:
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = WEIGHTS_TAG
            frozen.add(node)


def edge_config():
    """Edge compile settings of every export: no edge-IR validity check. It re-verifies the whole graph after each
    stage and changes nothing in the program (the same .pte and .ptd bytes for the tiny four-query program); without
    it that export took 68 and 76 s instead of 79 and 99 s on a 2-core x86 VM. A program with an op the runtime lacks
    still fails, when the runtime loads it: the suite runs every exported program."""
    from executorch.exir import EdgeCompileConfig

    return EdgeCompileConfig(_check_ir_validity=False)


def trace(
    module: nn.Module, methods: Methods, backend: str, weights_tag: WeightsTag, tag_computed: bool, joint: bool = False
) -> dict:
    """trace + tag: each method ``torch.export``-ed through ``MethodModule``; for XNNPACK its frozen constants are
    tagged (``tag_frozen``) so that what XNNPACK takes lands in the .ptd too. ``joint``: each method's graph also
    computes the gradient of its first output (the loss) with respect to the module's trainable parameters and
    returns it after its own outputs: the program ExecuTorch's training extension runs (``shared.fo_program``)."""
    from torch.export.experimental import _export_forward_backward

    programs = {}
    with torch.set_grad_enabled(joint):
        for method, (args, dynamic) in methods.items():
            # MethodModule takes *args, so its dynamic shapes nest once more than the unlifted module's.
            exported = torch.export.export(
                MethodModule(module, method), args, dynamic_shapes=(dynamic,) if dynamic else None, strict=False
            )
            if joint:
                exported = _export_forward_backward(exported)
                _plain_empties(exported)
            if backend == "xnnpack":
                tag_frozen(exported, weights_tag, tag_computed)
            programs[method] = exported
    return programs


def _plain_empties(exported) -> None:
    """A backward graph allocates some gradients with ``aten.empty_permuted``, which ExecuTorch has no kernel for;
    with the identity permutation (the only one seen) it is ``aten.empty``. Another permutation is refused."""
    for node in exported.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.empty_permuted.default:
            size, layout = node.args
            if list(layout) != list(range(len(layout))):
                raise NotImplementedError(f"aten.empty_permuted with the layout {list(layout)}: no ExecuTorch kernel")
            node.target, node.args = torch.ops.aten.empty.memory_format, (size,)
    exported.graph_module.recompile()


def _xnnpack_partitioner(joint: bool = False):
    """XNNPACK's partitioner, answering the edge stage's "which ops must not be decomposed" for what a program holds.
    ``joint``: also the matmuls of weights that are not constants (``force_non_static_weights_for_f32_linear``, as
    ExecuTorch's own LoRA fine-tuning example lowers): a backward pass's products of gradients, which portable
    kernels would otherwise run (a SmolLM2 first-order step: 10 s).

    XNNPACK keeps ``aten.linear`` whole where it can take the node (``check_op_support``: a constant weight, shapes
    it supports). Given that check, ``to_edge_transform_and_lower`` decomposes each method three times: once to
    functionalize it, once with the op kept, and once more after marking the nodes the check accepts, so that the
    others decompose. Where the check accepts every such node of a method — every linear of the training and
    inference programs, float32 and 8da4w — the third pass has nothing left to decide, and this partitioner answers
    without a check, which takes ExecuTorch's path of two passes: the same edge program, one re-trace of each large
    method less. A method with a node XNNPACK cannot take gets the check and the three passes.

    An 8da4w method is checked as it will be once functionalized (``subclass_weights_as_params``): its weights are
    torchao tensor subclasses, whose inner tensors the traced graph reads through ``access_subclass_inner_tensor``
    and the functional graph holds as parameters. XNNPACK's check wants a parameter there: on the traced graph as it
    is, it refuses every quantized linear, and an 8da4w method would take the three passes.
    """
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    class WholeMethodPartitioner(XnnpackPartitioner):
        def ops_to_not_decompose(self, ep):
            ops, check = super().ops_to_not_decompose(ep)
            if check is None:
                return ops, check
            kept = [node for node in ep.graph.nodes if node.op == "call_function" and node.target in ops]
            with subclass_weights_as_params():
                every = all(check(node) for node in kept)
            return (ops, None) if every else (ops, check)

        def partition(self, exported_program):
            # XnnpackPartitioner.partition only warns when it is not called from to_edge_transform_and_lower, which
            # it finds by reading every frame of the stack; _decomposed_once is that function's path, and checks
            # what it checks.
            return super(XnnpackPartitioner, self).partition(exported_program)

    return WholeMethodPartitioner(force_non_static_weights_for_f32_linear=True) if joint else WholeMethodPartitioner()


def inferred_sizes(graph_module: torch.fx.GraphModule):
    """A reshape (``view_copy``) with one symbolic size states it as ``-1`` (inferred): XNNPACK takes a reshape with
    one inferred size and none with a symbolic one, and the decompositions to the edge dialect write the sizes out
    (``linear`` of a rank-4 input: ``(rows * heads * width, d)``). The values are the same; only the program's
    description of the shape changes."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from torch.fx.passes.infra.pass_base import PassResult

    changed = False
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target == exir_ops.edge.aten.view_copy.default:
            sizes = list(node.args[1])
            symbolic = [i for i, size in enumerate(sizes) if not isinstance(size, int)]
            if len(symbolic) == 1 and -1 not in sizes:
                sizes[symbolic[0]] = -1
                node.args = (node.args[0], sizes, *node.args[2:])
                changed = True
    if changed:
        graph_module.graph.eliminate_dead_code()
        graph_module.recompile()
    return PassResult(graph_module, changed)


def to_edge(
    programs: dict,
    backend: str,
    bookkeeping: Callable = less_bookkeeping,
    quantize: str = "none",
    memory_mb: int | None = None,
    progress: Callable[[str], None] = lambda _: None,
    joint: bool = False,
):
    """lower: to the edge dialect, XNNPACK taking what it supports (``bookkeeping``: the context the stage runs in;
    the benchmark passes ``contextlib.nullcontext`` to measure what ``less_bookkeeping`` saves; ``quantize``: how the
    base's weights are quantized, ``memory_mb``: the memory the export may use, None: what the machine has; both
    size the export for ``lowering_processes``; ``progress`` is told where the methods are lowered; ``joint``: forward
    and backward graphs, ``_xnnpack_partitioner``).

    Each method is decomposed once (``_decomposed_once``) where XNNPACK's partitioner needs no per-node check;
    otherwise ExecuTorch's ``to_edge_transform_and_lower`` decides, node by node, what to keep whole."""
    from executorch.exir import to_edge_transform_and_lower

    partitioner = [_xnnpack_partitioner(joint)] if backend == "xnnpack" else []
    passes = [inferred_sizes] if backend == "xnnpack" else []
    with bookkeeping():
        kept = _kept_whole(programs, partitioner)
        if kept is not None:
            processes = lowering_processes(quantize, memory_mb, _weight_bytes(programs))
            apart = _methods_apart(programs) if processes > 1 else []
            if apart:
                progress(f"  lowering in two processes (the second: {', '.join(apart)}) ...")
                return _lowered_in_two_processes(programs, partitioner, passes, kept, apart)
            progress("  lowering in one process ...")
            return _decomposed_once(programs, partitioner, passes, kept)
        return to_edge_transform_and_lower(
            programs, transform_passes=passes, partitioner=partitioner, compile_config=edge_config()
        )


def _kept_whole(programs: dict, partitioner: list) -> list | None:
    """The ops the partitioner keeps whole in every method, from the decomposition table; None where it must check
    a node of some method first (then the edge stage decomposes in two steps around that check)."""
    from executorch.exir.program._program import _default_decomposition_table

    table = _default_decomposition_table()
    kept: set = set()
    for program in programs.values():
        for part in partitioner:
            ops, check = part.ops_to_not_decompose(program)
            if check is not None:
                return None
            kept.update(op for op in ops if op in table)
    return sorted(kept, key=str)


def _decomposed_once(programs: dict, partitioner: list, passes: list, kept: list):
    """What ``to_edge_transform_and_lower`` gives where no node needs the partitioner's check, with one
    decomposition of each method instead of two: ``exir.to_edge`` functionalizes and decomposes in one re-trace
    (the other path functionalizes first, so that the check sees the functional graph), keeping ``kept`` whole;
    then the same transform passes, partitions and check that every kept op was taken."""
    from dataclasses import replace as replace_config

    from executorch.exir import to_edge as exir_to_edge
    from executorch.exir.program._program import _sanity_check_graph_for_non_decomp_ops, lift_constant_tensor_pass

    config = replace_config(edge_config(), preserve_ops=list(kept))
    edge = exir_to_edge(programs, compile_config=config)
    if passes:
        edge = edge.transform(passes)
        for method in edge.methods:
            lift_constant_tensor_pass(edge.exported_program(method))
    for part in partitioner:
        edge = edge.to_backend(part)
    for name, program in edge._edge_programs.items():
        _sanity_check_graph_for_non_decomp_ops(name, program, kept, None, generate_error=True)
    return edge


LOWERING_PROCESSES_ENV = "MOBIZO_LOWERING_PROCESSES"


def lowering_processes(quantize: str = "none", memory_mb: int | None = None, weight_bytes: int = 0) -> int:
    """How many processes lower a program's methods: two where this process may run on two CPUs or more (and
    ``fork`` exists) and the memory available, or ``memory_mb`` where that is less (a server's compile budget), is
    at least twice what one process's export needs (``memory.export_need_mb`` of ``weight_bytes``, the traced
    weights counted as float32, quantized as ``quantize`` says), one otherwise. The second process shares the
    first's weights, and sends none back that the first holds (``_weights_out``): SmolLM2's float32 program peaked
    in two at about 1.07x one's need, its 8da4w program at 1.11 to 1.16x (``benchmarks/export_time.py``).
    ``MOBIZO_LOWERING_PROCESSES`` (1 or 2) decides instead."""
    configured = os.environ.get(LOWERING_PROCESSES_ENV, "").strip()
    if configured:
        return 1 if configured == "1" else 2
    if not hasattr(os, "fork") or not hasattr(os, "sched_getaffinity"):
        return 1
    if len(os.sched_getaffinity(0)) < 2:
        return 1
    available = memory.free_memory_mb()
    if memory_mb is not None:
        available = memory_mb if available is None else min(available, memory_mb)
    need = memory.export_need_mb(weight_bytes, quantize)
    return 2 if available is not None and available >= 2 * need else 1


def _weight_bytes(programs: dict) -> int:
    """Bytes of the traced programs' weights and constants, each tensor counted once (the methods share them)."""
    tensors = {}
    for program in programs.values():
        for tensor in (*program.state_dict.values(), *program.constants.values()):
            if type(tensor) in (torch.Tensor, nn.Parameter):
                tensors[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            elif isinstance(tensor, torch.Tensor):  # a quantized weight (a subclass): at its float dtype's size
                tensors[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(tensors.values())


def _methods_apart(programs: dict) -> list[str]:
    """The methods a second process lowers: the two sides' nodes balanced, the largest method staying here; none
    where there is a single method or the second side would get next to nothing."""
    sizes = {name: len(program.graph.nodes) for name, program in programs.items()}
    here, there, apart = 0, 0, []
    for name in sorted(sizes, key=lambda n: -sizes[n]):
        if here <= there:
            here += sizes[name]
        else:
            there += sizes[name]
            apart.append(name)
    return apart if there >= 0.25 * (here + there) else []


def _lowered_in_two_processes(programs: dict, partitioner: list, passes: list, kept: list, apart: list[str]):
    """``_decomposed_once`` of ``programs`` with the methods ``apart`` lowered at the same time in a forked process:
    the lowering is Python bound, one core's work a method, and the methods are independent until the program is
    emitted. The child sends its lowered methods back through ExecuTorch's serialization of edge programs with
    delegates (``exir.serde``), without their weights (``_weights_out``, ``_weights_back``): the parent holds the same
    tensors, and the same XNNPACK blobs and tensors computed from the weights (a quantized weight's integers and
    scales) from its own methods. The emitted program's bytes are those of one process
    (``benchmarks/export_time.py``, ``tests/shared/test_lowering.py``). Where the child fails, or its weights are not
    all found here, this process lowers those methods itself."""
    import pickle
    import signal
    import sys
    import tempfile
    import traceback

    from executorch.exir.program._program import EdgeProgramManager

    parent = os.getpid()
    with tempfile.TemporaryFile(prefix="mobizo-lowered-") as file:  # no name: nothing left behind by a kill
        pid = os.fork()
        if pid == 0:  # the child: lower, write, exit without running the parent's cleanup
            code = 1
            try:
                die_with_parent(parent)  # a compile worker killed for its timeout leaves no lowering behind
                torch.set_num_threads(1)  # OpenMP's threads do not survive a fork (as in DataLoader's workers)
                edge = _decomposed_once({name: programs[name] for name in apart}, partitioner, passes, kept)
                sent = {name: _weights_out(edge.exported_program(name), programs[name]) for name in apart}
                pickle.dump(sent, file, protocol=pickle.HIGHEST_PROTOCOL)
                file.flush()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        status = None
        try:
            here = _decomposed_once({n: p for n, p in programs.items() if n not in apart}, partitioner, passes, kept)
            _, status = os.waitpid(pid, 0)
        finally:
            if status is None:  # this process's own lowering failed: stop the child
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        lowered = None
        if status == 0:
            file.seek(0)
            lowered = _weights_back(pickle.load(file), programs, here)
    if lowered is None:
        log.warning("lowering %s in a second process failed (above) or its weights differ: lowering here", apart)
        lowered = _decomposed_once({name: programs[name] for name in apart}, partitioner, passes, kept)
        lowered = {name: lowered.exported_program(name) for name in apart}
    edge = {name: lowered[name] if name in apart else here.exported_program(name) for name in programs}
    return EdgeProgramManager(edge, here._config_methods, edge_config())


def _lowered_modules(program) -> list:
    """The backend-lowered modules a method calls, in the order of its graph."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    return [m for m in program.graph_module.children() if isinstance(m, LoweredBackendModule)]


def _weights_out(program, traced) -> tuple:
    """A lowered method to send to another process: its serialized form with every weight left out that the
    receiver holds too, i.e. each delegate's named-data blob (the receiver's own methods hold the same, under the
    same key), each parameter or constant of a delegate's original program that is a tensor of ``traced`` (the
    method as traced, before the fork), and each other tensor there (computed from the weights: a quantized weight's
    integers, scales and zero points; the receiver's own methods compute the same) → (artifact, blobs' keys and
    sha256, tensors' names, computed tensors' names, sha256, dtypes and shapes)."""
    import hashlib

    from executorch.exir.serde.serialize import serialize

    ours = {id(t): name for name, t in (*traced.state_dict.items(), *traced.constants.items())}
    blobs, tensors, computed = [], [], []
    for index, module in enumerate(_lowered_modules(program)):
        store = module.named_data_store_output
        if store is not None:
            keys = {entry.buffer_index: key for key, entry in _data_entries(store)}
            for i, buffer in enumerate(store.buffers):
                if isinstance(buffer, bytes) and i in keys:
                    blobs.append((index, i, keys[i], hashlib.sha256(buffer).hexdigest()))
                    store.buffers[i] = b""
        original = module.original_module
        for table in (original.state_dict, original.constants):
            for name, value in table.items():
                if isinstance(value, torch.Tensor) and id(value) in ours:
                    tensors.append((index, name, ours[id(value)]))
                elif type(value) in (torch.Tensor, nn.Parameter) and value.is_contiguous():
                    computed.append((index, name, _digest(value), value.dtype, tuple(value.shape)))
                else:
                    continue  # a subclass, no tensor, or a strided view: sent as it is
                table[name] = torch.zeros((), dtype=value.dtype).expand(value.shape)
    return serialize(program), blobs, tensors, computed


def _digest(tensor: torch.Tensor) -> str:
    """The sha256 of a contiguous CPU tensor's bytes (read in place)."""
    import hashlib

    flat = tensor.detach().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy() if flat.numel() else b"").hexdigest()


def _data_entries(store) -> list:
    """(key, entry) of every datum of a delegate's named-data store, in the .pte or in a data file."""
    return [*store.pte_data.items(), *(item for data in store.external_data.values() for item in data.items())]


def _computed_here(here, traced: dict) -> dict:
    """(sha256, dtype, shape) → tensor, for every plain tensor of the delegates' original programs of the methods
    lowered here (``here``) that is not a tensor of the methods as traced (``traced``)."""
    ours = {id(t) for program in traced.values() for t in (*program.state_dict.values(), *program.constants.values())}
    held = {}
    for name in here.methods:
        for module in _lowered_modules(here.exported_program(name)):
            original = module.original_module
            for value in (*original.state_dict.values(), *original.constants.values()):
                if type(value) in (torch.Tensor, nn.Parameter) and value.is_contiguous() and id(value) not in ours:
                    key = (_digest(value), value.dtype, tuple(value.shape))
                    held.setdefault(key, value)
    return held


def _weights_back(sent: dict, traced: dict, here) -> dict | None:
    """The methods ``_weights_out`` sent, their weights put back from this process (``traced``: the methods as
    traced; ``here``: the methods lowered here) → name → program; None where one is not found or differs."""
    import hashlib

    from executorch.exir.serde.serialize import deserialize

    held = {}  # key -> blob, from the delegates lowered here
    for name in here.methods:
        for module in _lowered_modules(here.exported_program(name)):
            store = module.named_data_store_output
            if store is not None:
                for key, entry in _data_entries(store):
                    held.setdefault(key, store.buffers[entry.buffer_index])
    ours = {}
    for program in traced.values():
        ours.update(program.state_dict)
        ours.update(program.constants)
    computed_here = _computed_here(here, traced) if any(computed for *_, computed in sent.values()) else {}
    serde_log = logging.getLogger("executorch.exir.serde.export_serialize")
    level = serde_log.level
    serde_log.setLevel(logging.ERROR)  # "symbol ... did not appear": the width's symbol, unused by a small method
    try:
        out = {}
        for name, (artifact, blobs, tensors, computed) in sent.items():
            program = deserialize(artifact)
            modules = _lowered_modules(program)
            for index, i, key, digest in blobs:
                blob = held.get(key)
                if blob is None or hashlib.sha256(blob).hexdigest() != digest:
                    return None
                modules[index].named_data_store_output.buffers[i] = blob
            for index, tensor_name, our_name in tensors:
                table = _table_of(modules[index].original_module, tensor_name)
                if our_name not in ours or ours[our_name].shape != table[tensor_name].shape:
                    return None
                table[tensor_name] = ours[our_name]
            for index, tensor_name, digest, dtype, shape in computed:
                tensor = computed_here.get((digest, dtype, shape))
                if tensor is None:
                    return None
                _table_of(modules[index].original_module, tensor_name)[tensor_name] = tensor
            out[name] = program
        return out
    finally:
        serde_log.setLevel(level)


def _table_of(original, name: str) -> dict:
    """The state dict or the constants of a delegate's original program, whichever holds ``name``."""
    return original.state_dict if name in original.state_dict else original.constants


def emit(edge, weights_tag: WeightsTag, zero_buffers: Iterable[str] = (), bookkeeping: Callable = less_bookkeeping):
    """emit: memory planning (mutable buffers shared by the methods), ``zero_buffers`` initialised to zeros."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    zero = list(zero_buffers)
    with bookkeeping():
        return edge.to_executorch(
            ExecutorchBackendConfig(
                passes=[InitializedMutableBufferPass(zero)] if zero else [],
                emit_mutable_buffer_names=True,
                memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
                external_constants=weights_tag,
            )
        )


def lower(
    module: nn.Module,
    methods: Methods,
    backend: str,
    weights_tag: WeightsTag = frozen_weights_tag,
    quantize: str = "none",
    zero_buffers: Iterable[str] = (),
    progress: Callable[[str], None] = lambda _: None,
    memory_mb: int | None = None,
    joint: bool = False,
):
    """trace → to_edge → emit: the ExecuTorch program manager of ``module``'s ``methods``.

    ``weights_tag`` names what goes to the .ptd; ``quantize``: how the module's base weights are quantized (where
    they are, the values computed from frozen constants alone are tagged too: ``tag_frozen``); ``zero_buffers``
    (name substrings) are mutable buffers that start from zeros rather than whatever memory the runtime hands out;
    ``progress`` is told when each stage ends; ``memory_mb``: the memory the export may use (None: what the machine
    has), which with ``quantize`` decides whether a second process lowers (``lowering_processes``); ``joint``: forward
    and backward (``trace``)."""
    import time

    started = time.perf_counter()
    programs = trace(module, methods, backend, weights_tag, tag_computed=quantize != "none", joint=joint)
    nodes = sum(len(program.graph.nodes) for program in programs.values())
    progress(f"  traced {len(programs)} methods ({nodes:,} nodes) in {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    edge = to_edge(programs, backend, quantize=quantize, memory_mb=memory_mb, progress=progress, joint=joint)
    progress(f"  lowered to {backend} in {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    manager = emit(edge, weights_tag, zero_buffers)
    progress(f"  emitted in {time.perf_counter() - started:.0f} s")
    return manager


def planned_bytes(manager) -> dict[str, int]:
    """Bytes the emitted program's memory plan reserves for each method (activations, mutable state): what loading
    the method allocates."""
    return {plan.name: sum(plan.non_const_buffer_sizes) for plan in manager.executorch_program.execution_plan}


def program_file(path: Path, sha256: str | None = None) -> ProgramFile:
    """A manifest's reference to one of its files (``sha256`` when the caller already knows it)."""
    from shared.files import sha256_file

    return ProgramFile(file=path.name, sha256=sha256 or sha256_file(path), size=path.stat().st_size)


def store_tokenizer(tokenizer, store: Path) -> tuple[Path, str]:
    """The tokenizer as one JSON file in ``store``, named by its content (training and inference programs of a
    model share it) → (path, sha256)."""
    from shared.files import atomic_write_bytes, store_by_content
    from shared.tokenizer_file import tokenizer_bytes

    tmp = atomic_write_bytes(store / f".tokenizer.{os.getpid()}.tmp", tokenizer_bytes(tokenizer))
    return store_by_content(tmp, store, "tokenizer-", ".json")


@dataclass(frozen=True)
class ExportStart:
    """What every exporter starts from (``start_export``)."""

    out_pte: Path
    store: Path  # where the ``.ptd`` and the tokenizer go
    model: nn.Module
    tokenizer: Any
    started: float  # ``time.perf_counter()`` when the export began

    def seconds(self) -> float:
        """Seconds since the export began."""
        return time.perf_counter() - self.started


def start_export(model_dir: Path, out_pte: Path, store_dir: Path | None = None) -> ExportStart:
    """The preamble of every program's export: the clock started, the store folder (default: beside ``out_pte``)
    made, the model in ``model_dir`` loaded in float32 with its tokenizer."""
    from shared.hf_models import load_model

    started = time.perf_counter()
    out_pte = Path(out_pte)
    store_dir = Path(store_dir) if store_dir is not None else out_pte.parent
    store_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(Path(model_dir), "float32")
    return ExportStart(out_pte, store_dir, model, tokenizer, started)


@dataclass(frozen=True)
class Emitted:
    """What ``store`` wrote: the manifest's three file references and the memory plan of each method."""

    pte: ProgramFile
    ptd: ProgramFile
    tokenizer: ProgramFile
    planned: dict[str, int]


def store(manager, out_pte: Path, store_dir: Path, tokenizer) -> Emitted:
    """The ``.pte`` written atomically at ``out_pte``; its ``.ptd`` and the tokenizer content-addressed in
    ``store_dir`` (reused when present)."""
    from shared.files import atomic_write

    atomic_write(out_pte, manager.write_to_file)
    ptd_path, ptd_sha = store_weights(manager, store_dir)
    tok_path, tok_sha = store_tokenizer(tokenizer, store_dir)
    return Emitted(
        program_file(out_pte), program_file(ptd_path, ptd_sha), program_file(tok_path, tok_sha), planned_bytes(manager)
    )
