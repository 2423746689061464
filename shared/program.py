"""The device program: the Mobile MP-LoRA training step and its export to an ExecuTorch ``.pte``.

An inference engine only runs ``forward()``, so the whole ZO-SGD step lives inside one: regenerate z from the
seed (``shared.noise``), run the 2q perturbed paths in one pass (``shared.lora``), per-path losses, projected
gradients, update of the master B — all by ``shared.zo.zo_step``, the same function eager training uses. The
master B is one flat float32 mutable buffer that persists across ``execute()`` calls; extra methods read it, set
it and evaluate with it. The ``.pte`` carries no value for B (its buffer is memory-planned, uninitialised): the
device always sets B with ``set_lora_b`` before step 1 — zeros, a previous adapter's B, or a checkpoint's — so
no program holds copies of a starting B, and one program serves every starting point. The methods are listed in
docs/contracts.md; the program's config and manifest (torch-free) in ``shared.manifest``.

Export pipeline: ``torch.export`` per method → ``to_edge_transform_and_lower`` (XNNPACK takes the frozen matmuls;
the integer noise and B stay in portable kernels) → ``to_executorch`` with the frozen weights tagged into a
separate ``.ptd``. That data file depends only on the base model and A, so it is byte-identical across q, E and
users: it is stored once, content-addressed, and every program of the model shares it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

from shared.batch import Batch, position_ids
from shared.lora import MPLoRA
from shared.manifest import (
    FORMAT_VERSION,
    PROGRAM_METHODS,
    ProgramConfig,
    ProgramFile,
    ProgramInputs,
    ProgramManifest,
    init_b_path,
    manifest_path,
    read_manifest,
)
from shared.ptd import WEIGHTS_TAG, store_weights
from shared.zo import candidate_scores, forward_losses, zo_step


class MobileMPLoRA(nn.Module):
    """The exportable step module: ``forward`` is one whole ZO-SGD step; B is a mutable buffer."""

    def __init__(
        self,
        model: nn.Module,
        lora: MPLoRA,
        q: int,
        init_b: torch.Tensor | None = None,
        parallel: str = "both",
        candidates: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.model = model
        self.lora = lora
        self.q = q
        self.parallel = parallel
        self.register_buffer("lora_b", lora.zeros() if init_b is None else init_b.clone().to(torch.float32))
        # The classification objective's candidate ids (a constant of the .pte, not of the shared .ptd).
        ids = torch.tensor(candidates, dtype=torch.long, device=self.lora_b.device) if candidates else None
        self.register_buffer("candidate_ids", ids)

    def _batch(self, input_ids, attention_mask, targets) -> Batch:
        return Batch(input_ids, attention_mask, position_ids(attention_mask), targets, self.candidate_ids)

    def forward(self, input_ids, attention_mask, targets, seed, lr, eps):
        batch = self._batch(input_ids, attention_mask, targets)
        step = (self.lora_b, seed, lr, eps, self.q, self.parallel)
        losses, g, b_new = zo_step(self.model, self.lora, batch, *step, trim=False)
        self.lora_b.copy_(b_new)
        return losses, g

    def get_lora_b(self) -> torch.Tensor:
        return self.lora_b.clone()

    def set_lora_b(self, b_flat: torch.Tensor) -> torch.Tensor:
        self.lora_b.copy_(b_flat)
        return self.lora_b.clone()

    def evaluate(self, input_ids, attention_mask, targets) -> torch.Tensor:
        """With the master B, no perturbation: per-example losses [N] (objective ``lm``), or each row's candidates'
        log-likelihoods [N, C] (``classification``: every candidate scored in the one pass)."""
        self.lora.apply(self.lora_b[None])
        try:
            batch = self._batch(input_ids, attention_mask, targets)
            if self.candidate_ids is not None:
                return candidate_scores(self.model, batch)
            return forward_losses(self.model, batch)
        finally:
            self.lora.apply(None)

    def example_inputs(self, cfg: ProgramConfig) -> dict[str, tuple]:
        """Inputs that fix each method's shapes (one program = one shape)."""
        rows = cfg.examples_per_query * cfg.q
        ids = torch.zeros(rows, cfg.seq_len, dtype=torch.long)
        mask = torch.ones(rows, cfg.seq_len, dtype=torch.long)
        targets = torch.zeros(rows, cfg.answer_len, dtype=torch.long)
        return {
            "forward": (ids, mask, targets, torch.tensor([1]), torch.tensor([1e-4]), torch.tensor([1e-2])),
            "get_lora_b": (),
            "set_lora_b": (torch.zeros(self.lora.size),),
            "evaluate": (ids, mask, targets),
        }


class MethodModule(nn.Module):
    """Exposes one method of the step module as ``forward`` so that torch.export can trace it.

    Every method is traced through the same attribute name (``program``), so the B buffer has the same name in
    all of them and ``share_mutable_buffers`` gives them one allocation.
    """

    def __init__(self, program: MobileMPLoRA, method: str) -> None:
        super().__init__()
        self.program = program
        self.method = method

    def forward(self, *args):
        return getattr(self.program, self.method)(*args)


def build_step_module(model: nn.Module, cfg: ProgramConfig, init_b: torch.Tensor | None = None) -> MobileMPLoRA:
    """Inject MP-LoRA into ``model`` (in place), quantize its base linears as ``cfg`` says, wrap it as the step
    module."""
    from shared.lora import inject_lora
    from shared.quantize import quantize_base

    model.config.use_cache = False
    lora = inject_lora(model, cfg.targets, cfg.rank, cfg.alpha, cfg.a_seed)
    quantize_base(model, cfg.quantize, cfg.group_size)
    return MobileMPLoRA(model, lora, cfg.q, init_b, cfg.parallel, cfg.candidates)


def is_frozen_weight(node: torch.fx.Node) -> bool:
    """Everything constant goes to the shared .ptd — base weights and the frozen A (the same for every program
    of a model with the default rank, targets and A seed); the mutable B is neither: it has no value in any file
    (the device sets it before step 1).

    Without this, each method that uses A carries its own copy in the .pte (SmolLM2: 2 x 2.2 MB). The
    classification objective's candidate ids stay in the .pte too: they are the task's, and the .ptd the model's.
    """
    name = str(node.target if node.op == "get_attr" else node.name)
    return "lora_b" not in name and "candidate_ids" not in name


def _weights_tag(node: torch.fx.Node) -> str | None:
    return WEIGHTS_TAG if is_frozen_weight(node) else None


def _tag_delegate_constants(module: nn.Module) -> None:
    """Tag what XNNPACK serializes as constants of a quantized program so that it goes to the .ptd: the frozen
    get_attr nodes, and every node computed from frozen nodes only. XNNPACK reads the tag on the node that feeds the
    linear: for a quantized weight that is the ``dequantize_affine`` of (int weight, scales, zero points), not the
    get_attr — without the second rule the 4-bit weights and their scales land in the .pte (SmolLM2: 64 MB).
    Float32 programs tag the get_attr nodes alone (``lower``): computed values depend on the program's graph, and
    tagging them would give each program its own .ptd instead of the model's shared one.
    """
    for graph_module in module.modules():
        if not isinstance(graph_module, torch.fx.GraphModule):
            continue
        frozen: set[torch.fx.Node] = set()
        for node in graph_module.graph.nodes:
            computed = node.op == "call_function" and node.all_input_nodes
            if (node.op == "get_attr" and is_frozen_weight(node)) or (
                computed and all(n in frozen for n in node.all_input_nodes)
            ):
                node.meta.setdefault("custom", {})["delegate_constant_tag"] = WEIGHTS_TAG
                frozen.add(node)


def edge_config():
    """Edge compile settings of every export: no edge-IR validity check. It re-verifies the whole graph after each
    stage and changes nothing in the program (the same .pte and .ptd bytes for the tiny four-query program); without
    it that export took 68 and 76 s instead of 79 and 99 s on a 2-core x86 VM. A program with an op the runtime lacks
    still fails, when the runtime loads it: the suite runs every exported program."""
    from executorch.exir import EdgeCompileConfig

    return EdgeCompileConfig(_check_ir_validity=False)


def lower(step: nn.Module, cfg: ProgramConfig):
    """torch.export each method → edge (XNNPACK for the frozen matmuls) → ExecuTorch program manager.

    The methods are those of ``step.example_inputs(cfg)``: a step module's four, or a benchmark's plain forward."""
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

    inputs = step.example_inputs(cfg)
    programs = {}
    with torch.no_grad():
        for method, args in inputs.items():
            exported = torch.export.export(MethodModule(step, method), args, strict=False)
            if cfg.backend == "xnnpack":
                # Weights that XNNPACK takes are tagged before lowering, so they too land in the .ptd.
                unlifted = exported.module()
                if cfg.quantize == "none":
                    delegate_external_constants_pass_unlifted(unlifted, _weights_tag)
                else:
                    _tag_delegate_constants(unlifted)
                exported = torch.export.export(unlifted, args, strict=False)
            programs[method] = exported
    partitioner = []
    if cfg.backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        partitioner = [XnnpackPartitioner()]
    edge = to_edge_transform_and_lower(programs, partitioner=partitioner, compile_config=edge_config())
    return edge.to_executorch(
        ExecutorchBackendConfig(
            emit_mutable_buffer_names=True,
            memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
            external_constants=_weights_tag,
        )
    )


def store_tokenizer(tokenizer, store: Path) -> tuple[Path, str]:
    """The tokenizer as one JSON file in ``store``, named by its content (training and inference programs of a
    model share it) → (path, sha256)."""
    from shared.files import atomic_write_bytes, store_by_content
    from shared.tokenizer_file import tokenizer_bytes

    tmp = atomic_write_bytes(store / f".tokenizer.{os.getpid()}.tmp", tokenizer_bytes(tokenizer))
    return store_by_content(tmp, store, "tokenizer-", ".json")


def _adapter_b(init_adapter: Path, cfg: ProgramConfig, lora: list) -> torch.Tensor:
    """The flat B of a previous adapter for a program of ``cfg`` whose LoRA modules are ``lora`` (a manifest's);
    ``UsageError`` naming ``adapter`` when its layout is another."""
    from shared.adapter import read_adapter
    from shared.errors import UsageError
    from shared.lora import join_b

    config, _, lora_b = read_adapter(init_adapter)
    if int(config["r"]) != cfg.rank or set(config["target_modules"]) != set(cfg.targets):
        raise UsageError("adapter", f"rank/targets {config['r']}/{config['target_modules']} do not match the program")
    try:
        return join_b(lora_b, {m.name: (m.out_features, cfg.rank) for m in lora})
    except ValueError as error:
        raise UsageError("adapter", str(error)) from None


def start_from_adapter(pte: Path, init_adapter: Path) -> ProgramManifest:
    """Make the program ``pte`` start from a previous adapter's B (continued personalization): the B goes beside it
    as a B file (``FILE.init.safetensors``), named in its manifest as ``init_b``; the ``.pte`` is unchanged (B is
    a buffer the device sets), so any program of the layout can start from any adapter of it → the manifest."""
    from shared.files import atomic_write_bytes

    manifest = read_manifest(pte)
    init_b = _adapter_b(init_adapter, manifest.config, manifest.lora)
    manifest = manifest.model_copy(update={"init_b": _init_b_file(Path(pte), init_b)})
    atomic_write_bytes(manifest_path(pte), manifest.to_json())
    return manifest


def export_program(
    model_dir: Path,
    cfg: ProgramConfig,
    out_pte: Path,
    store: Path | None = None,
    init_adapter: Path | None = None,
    progress=print,
) -> ProgramManifest:
    """Compile a Mobile MP-LoRA training program for the model in ``model_dir``.

    Writes ``out_pte`` and its manifest ``out_pte.with_suffix('.json')``; the base weights and the tokenizer go to
    ``store`` (default: beside the program) as ``weights-<sha256>.ptd`` and ``tokenizer-<sha256>.json``, reused
    when present. Returns the manifest.
    """
    from shared.files import atomic_write, atomic_write_bytes
    from shared.hf_models import load_model

    out_pte = Path(out_pte)
    store = Path(store) if store is not None else out_pte.parent
    store.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, tokenizer = load_model(model_dir, "float32")
    step = build_step_module(model, cfg)
    if init_adapter is not None:  # refused now, not after the export
        _adapter_b(init_adapter, cfg, step.lora.modules)
    progress(
        f"exporting {cfg.q}x{cfg.examples_per_query} paths x2 ({cfg.parallel}), seq {cfg.seq_len}, "
        f"backend {cfg.backend}, base weights {cfg.quantize} ..."
    )
    manager = lower(step, cfg)
    atomic_write(out_pte, manager.write_to_file)
    ptd_path, ptd_sha = store_weights(manager, store)
    tok_path, tok_sha = store_tokenizer(tokenizer, store)
    manifest = ProgramManifest(
        format=FORMAT_VERSION,
        model=str(Path(model_dir).resolve()),
        config=cfg,
        methods=list(PROGRAM_METHODS),
        lora=step.lora.modules,
        lora_size=step.lora.size,
        inputs=_input_spec(cfg),
        pte=program_file(out_pte),
        ptd=program_file(ptd_path, ptd_sha),
        tokenizer=program_file(tok_path, tok_sha),
        memory_mb=memory_estimate_mb(model.config, cfg, ptd_path.stat().st_size + out_pte.stat().st_size),
        export_seconds=round(time.perf_counter() - started, 2),
    )
    atomic_write_bytes(manifest_path(out_pte), manifest.to_json())
    if init_adapter is not None:
        manifest = start_from_adapter(out_pte, init_adapter)
    progress(
        f"wrote {out_pte} ({manifest.pte.size} B), {ptd_path.name} ({manifest.ptd.size} B) "
        f"in {manifest.export_seconds} s"
    )
    return manifest


def _init_b_file(out_pte: Path, init_b: torch.Tensor) -> ProgramFile:
    """The starting B as a B file beside the program (``FILE.init.safetensors``), named in the manifest."""
    from shared.b_file import b_file_bytes
    from shared.files import atomic_write_bytes

    path = atomic_write_bytes(init_b_path(out_pte), b_file_bytes(init_b.numpy()))
    return program_file(path)


def program_file(path: Path, sha256: str | None = None) -> ProgramFile:
    """A manifest's reference to one of its files (``sha256`` when the caller already knows it)."""
    from shared.files import sha256_file

    return ProgramFile(file=path.name, sha256=sha256 or sha256_file(path), size=path.stat().st_size)


def memory_estimate_mb(model_config, cfg: ProgramConfig, file_bytes: int) -> int:
    """RAM a device needs to run the program: its files, plus the activations of one layer for all 2q paths at
    once (attention scores and MLP), plus the answer logits, with 50% headroom for the runtime's planned buffers.

    An estimate for the server's lease filter (a job is not leased to a device that reports less free memory),
    not a guarantee.
    """
    tokens = 2 * cfg.batch_size * cfg.seq_len  # 2q paths of E rows each
    hidden, inner = model_config.hidden_size, model_config.intermediate_size
    heads = model_config.num_attention_heads
    layer = tokens * (6 * hidden + 3 * inner) + 2 * cfg.batch_size * heads * cfg.seq_len**2
    logits = 2 * cfg.batch_size * (cfg.answer_len + 1) * model_config.vocab_size * 2
    return int((file_bytes + 1.5 * 4 * (layer + logits)) / 2**20) + 1


def _input_spec(cfg: ProgramConfig) -> ProgramInputs:
    rows = cfg.q * cfg.examples_per_query
    return ProgramInputs(
        forward={
            "input_ids": [rows, cfg.seq_len],
            "attention_mask": [rows, cfg.seq_len],
            "targets": [rows, cfg.answer_len],
            "seed": [1],
            "lr": [1],
            "eps": [1],
        },
        padding="left; answers end at the last column; targets hold the last answer_len tokens or -100",
    )
