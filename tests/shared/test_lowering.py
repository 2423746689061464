"""The export pipeline's own invariants (``shared.lowering``), on a module small enough to export in seconds."""

import contextlib

import torch
from torch import nn

from shared import et_patches, lowering


class Interleaved(nn.Module):
    """Frozen linears separated by an operator XNNPACK does not take (``cumsum``): three partitions of one method,
    so carving partitions out of a graph and the passes' provenance both run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.third = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        x = self.first(x).cumsum(-1)
        x = self.second(x).cumsum(-1)
        return self.third(x).relu()


def _program(bookkeeping) -> tuple[bytes, int]:
    methods = {"forward": ((torch.randn(2, 8),), None)}
    programs = lowering.trace(Interleaved(), methods, "xnnpack", lowering.frozen_weights_tag, tag_computed=False)
    manager = lowering.emit(
        lowering.to_edge(programs, "xnnpack", bookkeeping), lowering.frozen_weights_tag, (), bookkeeping
    )
    (plan,) = manager.executorch_program.execution_plan
    delegates = sum(type(i.instr_args).__name__ == "DelegateCall" for i in plan.chains[0].instructions)
    return manager.buffer, delegates


def test_the_bookkeeping_cuts_leave_the_program_byte_identical() -> None:
    """``less_bookkeeping`` changes how the edge stages keep their records (graph-module code generated once,
    shared provenance) and skips XNNPACK passes with nothing to do (the last partition's ``relu`` is fused by one
    it keeps), never what they emit: a torch or ExecuTorch upgrade that breaks that shows here as different bytes."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir.backend import backend_api
    from executorch.exir.program import _program as exir_program
    from torch.fx.traceback import NodeSource

    def patched():
        return (
            exir_program._get_aten_to_edge_passes,
            exir_program.edge_to_executorch_passes,
            NodeSource.__init__,
            XNNPACKPassManager.transform,
            backend_api._create_partitions_in_graph_module,
            NamedDataStore.add_named_data,
            XnnpackBackend.__dict__.get("copy_exported_program_for_preprocess"),
        )

    before = patched()
    shipped, delegates = _program(lowering.less_bookkeeping)
    assert patched() == before  # put back after the lowering
    plain, plain_delegates = _program(contextlib.nullcontext)
    assert delegates == plain_delegates == 3
    assert shipped == plain


class TwoMethods(nn.Module):
    """Two methods over the same frozen linears (as ``forward`` and ``evaluate`` share a model's base)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.second(self.first(x).relu())

    def evaluate(self, x):
        return self.second(self.first(x).tanh())


def _stored_weights(bookkeeping) -> tuple[bytes, dict[str, list]]:
    """The program's bytes, and for each named-data key the bytes objects each method's partitions hold for it."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    x = (torch.randn(2, 8),)
    methods = {"forward": (x, None), "evaluate": (x, None)}
    programs = lowering.trace(TwoMethods(), methods, "xnnpack", lowering.frozen_weights_tag, tag_computed=False)
    edge = lowering.to_edge(programs, "xnnpack", bookkeeping)
    held: dict[str, list] = {}
    for program in edge._edge_programs.values():
        for module in program.graph_module.modules():
            if isinstance(module, LoweredBackendModule) and module.named_data_store_output is not None:
                out = module.named_data_store_output
                for key, entry in (out.pte_data | out.external_data.get(lowering.WEIGHTS_TAG, {})).items():
                    held.setdefault(key, []).append(out.buffers[entry.buffer_index])
    return lowering.emit(edge, lowering.frozen_weights_tag, (), bookkeeping).buffer, held


def test_a_partition_is_copied_for_xnnpack_with_its_weights_shared() -> None:
    """ExecuTorch deep-copies each partition's program before the backend preprocesses it; under
    ``less_bookkeeping`` XNNPACK's copy is a new graph and state dict over the same weight tensors, and the weights
    are as they were after the lowering (XNNPACK writes into none of them)."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    module = TwoMethods()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    x = (torch.randn(2, 8),)
    programs = lowering.trace(module, {"forward": (x, None)}, "xnnpack", lowering.frozen_weights_tag, False)
    (program,) = programs.values()
    with lowering.less_bookkeeping():
        copied = XnnpackBackend.copy_exported_program_for_preprocess(program, [])
    lowering.emit(lowering.to_edge(programs, "xnnpack"), lowering.frozen_weights_tag)  # in less_bookkeeping too
    plain = XnnpackBackend.copy_exported_program_for_preprocess(program, [])
    assert copied.graph_module is not program.graph_module and copied.state_dict is not program.state_dict
    assert program.state_dict and all(copied.state_dict[k] is t for k, t in program.state_dict.items())
    assert not any(plain.state_dict[k] is t for k, t in program.state_dict.items())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_a_weight_two_methods_use_is_held_once_in_memory() -> None:
    """Each method's XNNPACK partitions store the weights they take; with ``less_bookkeeping`` a weight both methods
    take is one bytes object (without it, one per method), and the program's bytes are the same."""
    shipped, held = _stored_weights(lowering.less_bookkeeping)
    plain, plain_held = _stored_weights(contextlib.nullcontext)
    assert shipped == plain
    assert held.keys() == plain_held.keys() and len(held) == 4  # two weights and two biases
    assert all(len(objects) == 2 for objects in held.values())
    assert all(a is b for a, b in held.values())
    assert not any(a is b for a, b in plain_held.values()) and all(a == b for a, b in plain_held.values())


def test_the_weights_that_size_the_second_process_are_counted_once_across_methods() -> None:
    """``lowering_processes`` sizes an export by its traced weights: two methods over the same linears count them
    once (8x8 + 8 and 8x4 + 4 float32 values)."""
    x = (torch.randn(2, 8),)
    methods = {"forward": (x, None), "evaluate": (x, None)}
    programs = lowering.trace(TwoMethods(), methods, "xnnpack", lowering.frozen_weights_tag, tag_computed=False)
    assert lowering._weight_bytes(programs) == 4 * (8 * 8 + 8 + 8 * 4 + 4)


def _in_one_then_two(monkeypatch, export):
    """``export()`` lowering in one process, then in two → (its result in one, in two, what the second process sent,
    the methods put back from it: None where they were not)."""
    monkeypatch.setenv(lowering.LOWERING_PROCESSES_ENV, "1")
    one = export()
    back = []
    weights_back = lowering._weights_back

    def spy(sent, traced, here):
        back.append((sent, weights_back(sent, traced, here)))
        return back[-1][1]

    monkeypatch.setattr(lowering, "_weights_back", spy)
    monkeypatch.setenv(lowering.LOWERING_PROCESSES_ENV, "2")
    two = export()
    ((sent, lowered),) = back
    return one, two, sent, lowered


def test_methods_lowered_in_a_second_process_make_the_program_of_one(monkeypatch) -> None:
    """With two processes a forked one lowers the methods of its share (here ``evaluate``) and sends them back
    without their weights: neither XNNPACK's blobs nor the delegates' tensors travel, this process puts back its
    own (the very blob objects its ``forward`` holds), and the program's bytes are those of one process."""
    (one, _), (two, held), sent, lowered = _in_one_then_two(
        monkeypatch, lambda: _stored_weights(lowering.less_bookkeeping)
    )
    assert list(sent) == ["evaluate"] and lowered is not None  # lowered there, every weight found here
    _, blobs, tensors, computed = sent["evaluate"]
    assert len(blobs) == len(tensors) == 4 and not computed  # two weights and two biases, none of them sent
    assert two == one
    assert len(held) == 4 and all(a is b for a, b in held.values())


class QuantizedMethods(nn.Module):
    """Two methods over the same 8da4w linears (as ``forward`` and ``evaluate`` share a quantized base)."""

    def __init__(self) -> None:
        super().__init__()
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerGroup

        torch.manual_seed(0)
        self.first, self.second = nn.Linear(64, 64), nn.Linear(64, 16)
        quantize_(self, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)))

    def forward(self, x):
        return self.second(self.first(x).relu())

    def evaluate(self, x):
        return self.second(self.first(x).tanh())


def test_a_quantized_methods_computed_weights_stay_in_the_second_process(monkeypatch) -> None:
    """An 8da4w method lowered in a second process holds tensors computed from the traced weights (each weight's
    integers, scales and zero points), not the traced ones: they do not travel either, this process puts back its own
    tensors of the same bytes (the very objects its ``forward`` holds), and the program's bytes are those of one
    process. The export says where its methods are lowered."""
    x = (torch.randn(2, 64),)
    methods = {"forward": (x, None), "evaluate": (x, None)}
    held, told = [], []

    def program() -> bytes:
        programs = lowering.trace(QuantizedMethods(), methods, "xnnpack", lowering.frozen_weights_tag, True)
        edge = lowering.to_edge(programs, "xnnpack", quantize="8da4w", progress=told.append)
        held.append(lowering._computed_here(edge, programs))
        return lowering.emit(edge, lowering.frozen_weights_tag).buffer

    one, two, sent, lowered = _in_one_then_two(monkeypatch, program)
    assert told == ["  lowering in one process ...", "  lowering in two processes (the second: evaluate) ..."]
    assert list(sent) == ["evaluate"] and lowered is not None  # lowered there, every tensor found here
    _, blobs, _, computed = sent["evaluate"]
    assert blobs and len(computed) == 6, computed  # two weights' integers, scales and zero points, none of them sent
    ours = {id(t) for t in held[-1].values()}
    evaluate = [m.original_module for m in lowering._lowered_modules(lowered["evaluate"])]
    for index, name, *_ in computed:
        assert id(lowering._table_of(evaluate[index], name)[name]) in ours  # forward's own tensor
    assert two == one


def test_a_failed_second_process_leaves_its_methods_to_this_one(monkeypatch, caplog) -> None:
    """Where the forked process fails, this one lowers its methods itself, says so, and emits the same program."""
    import logging

    monkeypatch.setenv(lowering.LOWERING_PROCESSES_ENV, "1")
    one, _ = _stored_weights(lowering.less_bookkeeping)

    def fails(program, traced):
        raise RuntimeError("the second process fails (a test)")

    monkeypatch.setattr(lowering, "_weights_out", fails)
    monkeypatch.setenv(lowering.LOWERING_PROCESSES_ENV, "2")
    with caplog.at_level(logging.WARNING, logger=lowering.__name__):
        two, _ = _stored_weights(lowering.less_bookkeeping)
    assert "['evaluate'] in a second process failed" in caplog.text
    assert two == one


def test_the_second_process_gets_a_balanced_share_of_the_methods_or_none(monkeypatch) -> None:
    """The largest method stays, each next one goes to the lighter side; a share under a quarter of the nodes is
    not worth a process. One process where the environment says so, one CPU is there, or the memory available
    (or a compile budget under it) is under twice one process's need, which quantized weights change."""
    from types import SimpleNamespace

    def programs(**nodes):
        return {name: SimpleNamespace(graph=SimpleNamespace(nodes=range(n))) for name, n in nodes.items()}

    training = programs(forward=3323, get_lora_b=369, set_lora_b=371, evaluate=3000)  # SmolLM2's, in nodes
    assert lowering._methods_apart(training) == ["evaluate", "set_lora_b"]
    assert lowering._methods_apart(programs(forward=3323)) == []
    assert lowering._methods_apart(programs(forward=3323, get_lora_b=369, set_lora_b=371)) == []
    monkeypatch.setenv(lowering.LOWERING_PROCESSES_ENV, "1")
    assert lowering.lowering_processes() == 1
    monkeypatch.delenv(lowering.LOWERING_PROCESSES_ENV)
    monkeypatch.setattr(lowering.os, "sched_getaffinity", lambda pid: {0})
    assert lowering.lowering_processes() == 1
    monkeypatch.setattr(lowering.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    weights = 1499 * 2**19  # 749.5 MiB of float32 weights: one process's export needs 3000 MB
    assert lowering.memory.export_need_mb(weights) == 3000
    monkeypatch.setattr(lowering.memory, "free_memory_mb", lambda: 6000)
    assert lowering.lowering_processes(weight_bytes=weights) == 2
    quantized = lowering.memory.export_need_mb(weights, "8da4w")  # 8da4w: 2400 + 1.2 x 749.5 MiB
    assert quantized == 3300
    assert lowering.lowering_processes("8da4w", weight_bytes=weights) == 1  # 6000 MB: under twice its need
    assert lowering.lowering_processes(memory_mb=5999, weight_bytes=weights) == 1  # a compile budget under twice
    assert lowering.lowering_processes(memory_mb=60000, weight_bytes=weights) == 2  # the machine's memory decides
    monkeypatch.setattr(lowering.memory, "free_memory_mb", lambda: 2 * quantized)
    assert lowering.lowering_processes("8da4w", weight_bytes=weights) == 2
    assert lowering.lowering_processes("8da4w", memory_mb=2 * quantized - 1, weight_bytes=weights) == 1
    monkeypatch.setattr(lowering.memory, "free_memory_mb", lambda: 5999)  # under twice one process's need
    assert lowering.lowering_processes(weight_bytes=weights) == 1
    monkeypatch.setenv(lowering.LOWERING_PROCESSES_ENV, "2")
    assert lowering.lowering_processes("8da4w", weight_bytes=weights) == 2


class ScaledByWidth(nn.Module):
    """A linear whose output is scaled by the input's symbolic width: ``mul`` takes that size where its schema takes
    a tensor, which ExecuTorch's ``SymToTensorPass`` (one of the edge passes ``less_bookkeeping`` skips where they
    have nothing to do) must rewrite."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x) * x.shape[0]


def test_an_edge_pass_is_skipped_only_where_it_has_nothing_to_rewrite() -> None:
    """Each skipped pass's test sees its work: ``aten.t``, a view op, a symbolic size given as a tensor; the
    project's graphs have none. With a symbolic size that must become a tensor, the program is the same with and
    without the skips (and its edge graph holds the rewrite)."""
    from executorch.exir.passes import ReplaceBrokenOpsWithFunctionalOpsPass
    from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
    from executorch.exir.passes.sym_to_tensor_pass import SymToTensorPass

    triggers = et_patches._edge_pass_triggers()
    aten = torch.ops.aten
    transposed = torch.fx.symbolic_trace(lambda x: aten.t.default(x))
    viewed = torch.fx.symbolic_trace(lambda x: aten.view.default(x, [-1]))
    assert triggers[NormalizeTransposePass](transposed) and not triggers[NormalizeTransposePass](viewed)
    copied = torch.fx.symbolic_trace(lambda x: aten.view_copy.default(x, [-1]))
    assert triggers[ReplaceBrokenOpsWithFunctionalOpsPass](viewed)
    assert not triggers[ReplaceBrokenOpsWithFunctionalOpsPass](copied)

    width = torch.export.Dim("width", min=2, max=16)
    methods = {"forward": ((torch.randn(4, 8),), ({0: width},))}
    exported = torch.export.export(ScaledByWidth(), methods["forward"][0], dynamic_shapes=({0: width},))
    assert triggers[SymToTensorPass](exported.run_decompositions({}).graph_module)
    assert not triggers[SymToTensorPass](torch.export.export(Interleaved(), (torch.randn(2, 8),)).graph_module)

    def program(bookkeeping):
        programs = lowering.trace(ScaledByWidth(), methods, "xnnpack", lowering.frozen_weights_tag, False)
        edge = lowering.to_edge(programs, "xnnpack", bookkeeping)
        targets = {str(n.target) for n in edge.exported_program().graph.nodes}
        return lowering.emit(edge, lowering.frozen_weights_tag, (), bookkeeping).buffer, targets

    (shipped, targets), (plain, _) = program(lowering.less_bookkeeping), program(contextlib.nullcontext)
    assert any("scalar_tensor" in target for target in targets)
    assert shipped == plain


class MeanOf(nn.Module):
    """A mean over the last dimension (a portable ``mean.dim``), of a channels-last input or a contiguous one."""

    def __init__(self, channels_last: bool) -> None:
        super().__init__()
        self.channels_last = channels_last

    def forward(self, x):
        return (x.to(memory_format=torch.channels_last) if self.channels_last else x * 2).mean(-1)


def test_the_dim_order_pass_is_skipped_only_where_an_input_is_not_in_the_default_order() -> None:
    """``LegalizePortableDimOrderPass`` puts a contiguous copy before a portable ``mean`` of a channels-last input:
    its test sees that input and not a contiguous one, and the channels-last program is the same with and without
    the skip (its copy there)."""
    from executorch.exir.passes.legalize_portable_dim_order_pass import LegalizePortableDimOrderPass

    (needed,) = et_patches._emit_pass_triggers().values()
    x = (torch.randn(2, 3, 4, 5),)

    def edge(channels_last: bool):
        methods = {"forward": (x, None)}
        programs = lowering.trace(MeanOf(channels_last), methods, "portable", lowering.frozen_weights_tag, False)
        return lowering.to_edge(programs, "portable")

    assert needed(edge(True).exported_program().graph_module)
    assert not needed(edge(False).exported_program().graph_module)
    assert LegalizePortableDimOrderPass in et_patches._emit_pass_triggers()

    def program(bookkeeping) -> bytes:
        return lowering.emit(edge(True), lowering.frozen_weights_tag, (), bookkeeping).buffer

    assert program(lowering.less_bookkeeping) == program(contextlib.nullcontext)


class DynamicWeight(nn.Module):
    """A linear XNNPACK takes (a constant weight) and one it does not (the weight is an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.fixed = nn.Linear(8, 8)

    def forward(self, x, w):
        return nn.functional.linear(self.fixed(x), w)


def test_the_partitioner_answers_without_a_check_only_where_xnnpack_takes_every_kept_node() -> None:
    """Without a check ExecuTorch keeps every ``aten.linear`` whole (two decompositions instead of three): right
    where XNNPACK takes them all, wrong where one must decompose — that method keeps the check."""
    partitioner = lowering._xnnpack_partitioner()
    every = torch.export.export(Interleaved(), (torch.randn(2, 8),)).run_decompositions({})
    ops, check = partitioner.ops_to_not_decompose(every)
    assert torch.ops.aten.linear.default in ops and check is None
    one_not = torch.export.export(DynamicWeight(), (torch.randn(2, 8), torch.randn(4, 8))).run_decompositions({})
    assert partitioner.ops_to_not_decompose(one_not)[1] is not None


def test_one_decomposition_gives_the_program_of_executorchs_own_path(monkeypatch) -> None:
    """``to_edge`` decomposes each method once (``_decomposed_once``) where no node needs the partitioner's check;
    ExecuTorch's ``to_edge_transform_and_lower`` functionalizes first and decomposes after. Both give the same bytes:
    on XNNPACK where every linear is XNNPACK's (XNNPACK's own partitioner keeps its check, so ExecuTorch's path
    runs), where one is not (that one decomposed to portable kernels in both), and on portable kernels alone."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    def program(module, args, backend="xnnpack") -> bytes:
        programs = lowering.trace(module, {"forward": (args, None)}, backend, lowering.frozen_weights_tag, False)
        return lowering.emit(lowering.to_edge(programs, backend), lowering.frozen_weights_tag).buffer

    cases = [(Interleaved(), (torch.randn(2, 8),)), (DynamicWeight(), (torch.randn(2, 8), torch.randn(4, 8)))]
    ours = [program(*case) for case in cases]
    portable = program(*cases[0], backend="portable")
    monkeypatch.setattr(lowering, "_xnnpack_partitioner", XnnpackPartitioner)
    assert ours == [program(*case) for case in cases]
    monkeypatch.setattr(lowering, "_kept_whole", lambda programs, partitioner: None)  # ExecuTorch's path
    assert portable == program(*cases[0], backend="portable")


class WithState(nn.Module):
    """A parameter, a buffer the method mutates, and a constant buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("lora_b", torch.zeros(4))
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        self.lora_b.add_(1.0)
        return (x @ self.weight) * self.scale + self.lora_b


def test_only_constants_and_what_is_computed_from_them_alone_are_tagged_for_the_ptd() -> None:
    """The user's input and the mutable B are never tagged (their placeholders are not constants); the parameter
    and the constant buffer are."""
    exported = torch.export.export(WithState(), (torch.randn(2, 4),))
    lowering.tag_frozen(exported, lowering.frozen_weights_tag, tag_computed=False)
    tagged = {
        n.name for n in exported.graph.nodes if n.meta.get("custom", {}).get("delegate_constant_tag") == "weights"
    }
    sig = exported.graph_signature
    constants = {*sig.inputs_to_parameters, *sig.inputs_to_buffers}
    assert tagged == {name for name in constants if "lora_b" not in name}
    assert len(tagged) == 2


class Doubled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ (self.weight * 2) + x


def test_tag_computed_tags_what_is_computed_from_constants_alone() -> None:
    """With ``tag_computed`` (quantized programs) a value of constants alone (``weight * 2``) is tagged, a value
    that mixes in the input is not."""
    exported = torch.export.export(Doubled(), (torch.randn(2, 4),))
    lowering.tag_frozen(exported, lowering.frozen_weights_tag, tag_computed=True)
    tagged = [n for n in exported.graph.nodes if n.meta.get("custom", {}).get("delegate_constant_tag") == "weights"]
    assert [n.op for n in tagged] == ["placeholder", "call_function"]
    assert all(n.op != "call_function" or all(i in tagged for i in n.all_input_nodes) for n in tagged)


class TiedHead(nn.Module):
    """An embedding lookup (the portable kernel's: a constant the emitter places in the .ptd) whose table is also
    the weight of a linear head (XNNPACK's: named data it stores for the .ptd), as a tied LM head is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix = nn.Embedding(16, 8), nn.Linear(8, 8)

    def forward(self, ids):
        return torch.nn.functional.linear(self.mix(self.embed(ids)), self.embed.weight)


def test_the_weights_file_written_from_memory_is_executorchs_own_file_canonicalised(tmp_path) -> None:
    """``shared.ptd.store_weights`` writes the .ptd from the tensors the program manager holds: the same key -> (bytes,
    layout) pairs as the file ExecuTorch writes itself, so the same canonical bytes; the tied table, under both the
    lookup's key and XNNPACK's, is stored once."""
    from executorch.exir._serialize._cord import Cord
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    from shared.ptd import WEIGHTS_TAG, canonical_ptd, program_named_tensors, ptd_contents

    methods = {"forward": ((torch.tensor([[1, 5, 7]]),), None)}
    programs = lowering.trace(TiedHead(), methods, "xnnpack", lowering.frozen_weights_tag, tag_computed=False)
    manager = lowering.emit(lowering.to_edge(programs, "xnnpack"), lowering.frozen_weights_tag)
    manager.write_tensor_data_to_file(str(tmp_path))
    payload = FlatTensorSerializer().deserialize(Cord((tmp_path / f"{WEIGHTS_TAG}.ptd").read_bytes()))
    from_file = {k: (bytes(payload.buffers[e.buffer_index]), e.tensor_layout) for k, e in payload.named_data.items()}
    in_memory = program_named_tensors(manager)
    emitter, xnnpack = manager._emitter_output.external_constant_map, manager._named_data.external_data
    assert emitter[WEIGHTS_TAG] and xnnpack[WEIGHTS_TAG]  # both sources of the file are exercised
    assert {k: (bytes(b), layout) for k, (b, layout) in in_memory.items()} == from_file
    written = bytes(canonical_ptd(in_memory))
    assert written == bytes(canonical_ptd(from_file))
    contents = ptd_contents(written)
    table = TiedHead().embed.weight.detach().numpy().tobytes()
    assert sum(data == table for data, _ in from_file.values()) == 2  # the lookup's key and XNNPACK's
    assert len({segment for segment, _ in contents.values()}) == len(contents) - 1


class Quantized(nn.Module):
    """One 8da4w linear (int4 groupwise weights, int8 dynamic activations), as ``shared.quantize`` makes them."""

    def __init__(self) -> None:
        super().__init__()
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerGroup

        torch.manual_seed(0)
        self.linear = nn.Linear(64, 16)
        quantize_(self, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)))

    def forward(self, x):
        return self.linear(x).relu()


def test_an_8da4w_method_is_decomposed_once_into_executorchs_own_program(monkeypatch) -> None:
    """torchao's quantized weight is a tensor subclass: the traced graph reads its inner tensors through
    ``access_subclass_inner_tensor``, where XNNPACK's check wants the parameters the functional graph holds. The
    partitioner checks the linear as it will be once functionalized (no check left, so one decomposition), and the
    program is the one ExecuTorch's own path gives, with the linear in XNNPACK."""

    def traced() -> dict:
        methods = {"forward": ((torch.randn(2, 64),), None)}
        return lowering.trace(Quantized(), methods, "xnnpack", lowering.frozen_weights_tag, tag_computed=True)

    def program() -> tuple[bytes, list[str]]:
        manager = lowering.emit(lowering.to_edge(traced(), "xnnpack"), lowering.frozen_weights_tag)
        (plan,) = manager.executorch_program.execution_plan
        return manager.buffer, [op.name for op in plan.operators]

    programs = traced()
    inner = [n for n in programs["forward"].graph.nodes if "access_subclass_inner_tensor" in str(n.target)]
    assert inner, "the traced weight is no longer a tensor subclass: this test no longer covers the case"
    assert lowering._xnnpack_partitioner().ops_to_not_decompose(programs["forward"])[1] is None
    ours, operators = program()
    assert not any("linear" in op or "mm" in op for op in operators)  # the linear is XNNPACK's
    monkeypatch.setattr(lowering, "_kept_whole", lambda programs, partitioner: None)  # ExecuTorch's path
    assert program()[0] == ours


def test_the_speed_patches_apply_on_the_pinned_versions_only_and_are_undone_after() -> None:
    """``less_bookkeeping`` swaps ExecuTorch's and torch's private attributes inside its block and puts each back
    after; on versions other than ``PATCHED_FOR`` it touches none (the export runs as ExecuTorch's own)."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from torch.fx.traceback import NodeSource

    def attributes() -> tuple:
        return NodeSource.__init__, XNNPACKPassManager.transform, NamedDataStore.add_named_data

    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    exporting = pyproject["project"]["optional-dependencies"]["export"]  # the export extra pins them
    pins = dict(d.split("==") for d in exporting if d.startswith(("torch==", "executorch==")))
    assert et_patches.PATCHED_FOR == pins, "a new pin: re-derive shared/et_patches.py's patches, then its versions"
    assert et_patches.installed_versions() == et_patches.PATCHED_FOR
    before = attributes()
    with et_patches.less_bookkeeping():
        inside = attributes()
    assert all(i is not b for i, b in zip(inside, before, strict=True)) and attributes() == before
    other = {**et_patches.PATCHED_FOR, "executorch": "9.9.9"}
    with et_patches.less_bookkeeping(lambda: other):
        assert attributes() == before
    assert attributes() == before
