"""The device program: the Mobile MP-LoRA training step and its export to an ExecuTorch ``.pte``.

An inference engine only runs ``forward()``, so the whole ZO-SGD step lives inside one: regenerate z from the
seed (``shared.noise``), run the 2q perturbed paths in one pass (``shared.lora``), per-path losses, projected
gradients, update of the master B — all by ``shared.zo.zo_step``, the same function eager training uses. The
master B is one flat float32 mutable buffer that persists across ``execute()`` calls; extra methods read it, set
it and evaluate with it. A program whose optimizer keeps a state (``shared.zo_optim``: momentum's m, normalized's
v) holds it in a second flat mutable buffer, which ``set_lora_b`` zeros (a run starting from a B starts its state
too) and ``set_opt_state`` sets after it (a resumed run's state, rebuilt from its log). The ``.pte`` carries no value
for B (its buffer is memory-planned, uninitialised): the
device always sets B with ``set_lora_b`` before step 1 — zeros, a previous adapter's B, or a checkpoint's — so
no program holds copies of a starting B, and one program serves every starting point. The methods are listed in
docs/contracts.md; the program's config and manifest (torch-free) in ``shared.manifest``.

Export: the one pipeline of ``shared.lowering`` (XNNPACK takes the frozen matmuls; the integer noise and B stay
in portable kernels; the frozen weights go to a separate ``.ptd``). That data file depends only on the base model
and A, so it is byte-identical across q, E and users: it is stored once, content-addressed, and every program of
the model shares it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shared import lowering
from shared.batch import Batch, position_ids
from shared.lora import MPLoRA
from shared.lowering import Methods, program_file
from shared.manifest import (
    FORMAT_VERSION,
    ProgramConfig,
    ProgramFile,
    ProgramInputs,
    ProgramManifest,
    init_b_path,
    manifest_path,
    read_manifest,
)
from shared.zo import candidate_scores, forward_losses, zo_step
from shared.zo_optim import flat_state, state_of, state_size, update


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
        private: bool = False,
        optimizer: str = "sgd",
        prior: tuple[float, ...] = (),
        probe_weights: str = "none",
    ) -> None:
        super().__init__()
        self.private = private
        self.probe_weights = probe_weights
        self.optimizer = optimizer
        self.model = model
        self.lora = lora
        self.q = q
        self.parallel = parallel
        self.register_buffer("lora_b", lora.zeros() if init_b is None else init_b.clone().to(torch.float32))
        # The classification objective's candidate ids (a constant of the .pte, not of the shared .ptd).
        ids = torch.tensor(candidates, dtype=torch.long, device=self.lora_b.device) if candidates else None
        self.register_buffer("candidate_ids", ids)
        # A calibrated objective's prior [C] (``shared.calibration``): float32 constants of the .pte.
        prior_values = torch.tensor(prior, dtype=torch.float32, device=self.lora_b.device) if prior else None
        self.register_buffer("candidate_prior", prior_values)
        size = state_size(optimizer, lora.size)
        self.register_buffer("opt_state", torch.zeros(size, device=self.lora_b.device) if size else None)

    def _batch(self, input_ids, attention_mask, targets) -> Batch:
        return Batch(
            input_ids, attention_mask, position_ids(attention_mask), targets, self.candidate_ids, self.candidate_prior
        )

    def forward(self, input_ids, attention_mask, targets, seed, lr, eps, clip=None, g_noise=None):
        """One step; a private program's also takes the clip [1] and the noise of its g's [q]."""
        batch = self._batch(input_ids, attention_mask, targets)
        step = (self.lora_b, seed, lr, eps, self.q, self.parallel)
        apply = self._apply if self.opt_state is not None else None
        losses, g, b_new = zo_step(
            self.model,
            self.lora,
            batch,
            *step,
            trim=False,
            clip=clip,
            g_noise=g_noise,
            apply=apply,
            probe_weights=self.probe_weights,
        )
        self.lora_b.copy_(b_new)
        return losses, g

    def _apply(self, b: torch.Tensor, z: torch.Tensor, g: torch.Tensor, lr: torch.Tensor) -> torch.Tensor:
        """The optimizer's update, its state read from and written back to the buffer."""
        b_new, state = update(self.optimizer, b, z, g, lr, state_of(self.optimizer, self.opt_state))
        self.opt_state.copy_(flat_state(state))
        return b_new

    def get_lora_b(self) -> torch.Tensor:
        return self.lora_b.clone()

    def set_lora_b(self, b_flat: torch.Tensor) -> torch.Tensor:
        """Start from ``b_flat``, and the optimizer's state from zeros."""
        self.lora_b.copy_(b_flat)
        if self.opt_state is not None:
            self.opt_state.copy_(torch.zeros_like(self.opt_state))
        return self.lora_b.clone()

    def get_opt_state(self) -> torch.Tensor:
        return self.opt_state.clone()

    def set_opt_state(self, state: torch.Tensor) -> torch.Tensor:
        """The optimizer's state (``shared.zo_optim.flat_state``), after ``set_lora_b``: a resumed run's."""
        self.opt_state.copy_(state)
        return self.opt_state.clone()

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

    def example_inputs(self, cfg: ProgramConfig) -> Methods:
        """Each method's example inputs and dynamic shapes: ``forward`` and ``evaluate`` take any number of columns
        in ``cfg.widths`` (the rows, the answer columns and B are fixed)."""
        from torch.export import Dim

        rows = cfg.examples_per_query * cfg.q
        ids = torch.zeros(rows, cfg.seq_len, dtype=torch.long)
        mask = torch.ones(rows, cfg.seq_len, dtype=torch.long)
        targets = torch.zeros(rows, cfg.answer_len, dtype=torch.long)
        step = (ids, mask, targets, torch.tensor([1]), torch.tensor([1e-4]), torch.tensor([1e-2]))
        if self.private:
            step += (torch.tensor([1.0]), torch.zeros(cfg.q))
        columns = None
        if cfg.widths is not None:
            # DYNAMIC, not a named Dim: the attention's guards (e.g. min(64, 128*T) == 64) hold on the whole range
            # but are not all provable by the exporter.
            cols = {1: Dim.DYNAMIC(min=cfg.widths[0], max=cfg.widths[1])}
            columns = (cols, cols) + (None,) * (len(step) - 2)
        methods = {
            "forward": (step, columns),
            "get_lora_b": ((), None),
            "set_lora_b": ((torch.zeros(self.lora.size),), None),
            "evaluate": ((ids, mask, targets), columns[:3] if columns else None),
        }
        if self.opt_state is not None:
            methods |= {"get_opt_state": ((), None), "set_opt_state": ((torch.zeros_like(self.opt_state),), None)}
        return methods


def adapted_base(model: nn.Module, cfg: ProgramConfig) -> MPLoRA:
    """``model`` as a program of ``cfg`` runs it (in place): no KV cache, MP-LoRA of ``cfg``'s layout injected, the
    base linears quantized as ``cfg`` says → the LoRA. Every training program kind starts here (this module's step,
    ``shared.fo_program``'s first-order peer)."""
    from shared.lora import inject_lora
    from shared.quantize import quantize_base

    model.config.use_cache = False
    lora = inject_lora(model, cfg.targets, cfg.rank, cfg.alpha, cfg.a_seed)
    quantize_base(model, cfg.quantize, cfg.group_size)
    return lora


def build_step_module(model: nn.Module, cfg: ProgramConfig, init_b: torch.Tensor | None = None) -> MobileMPLoRA:
    """Inject MP-LoRA into ``model`` (in place), quantize its base linears as ``cfg`` says (``adapted_base``), wrap
    it as the step module."""
    lora = adapted_base(model, cfg)
    return MobileMPLoRA(
        model,
        lora,
        cfg.q,
        init_b,
        cfg.parallel,
        cfg.candidates,
        cfg.private,
        cfg.optimizer,
        cfg.prior,
        cfg.probe_weights,
    )


def lower(step: nn.Module, cfg: ProgramConfig, progress=lambda _: None, memory_mb: int | None = None):
    """A step module (or a benchmark's module with ``example_inputs``) through the one pipeline
    (``shared.lowering``), its base weights quantized as ``cfg`` says; ``progress`` is told
    when each stage ends; ``memory_mb``: the memory the export may use (None: what the machine has)."""
    return lowering.lower(
        step,
        step.example_inputs(cfg),
        cfg.backend,
        quantize=cfg.quantize,
        progress=progress,
        memory_mb=memory_mb,
    )


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
    memory_mb: int | None = None,
) -> ProgramManifest:
    """Compile a Mobile MP-LoRA training program for the model in ``model_dir``.

    Writes ``out_pte`` and its manifest ``out_pte.with_suffix('.json')``; the base weights and the tokenizer go to
    ``store`` (default: beside the program) as ``weights-<sha256>.ptd`` and ``tokenizer-<sha256>.json``, reused
    when present. ``memory_mb``: the memory the export may use (a server's compile budget; None: what the machine
    has). Returns the manifest.
    """
    start = lowering.start_export(model_dir, out_pte, store)
    out_pte = start.out_pte
    step = build_step_module(start.model, cfg)
    if init_adapter is not None:  # refused now, not after the export
        _adapter_b(init_adapter, cfg, step.lora.modules)
    progress(
        f"exporting {cfg.q}x{cfg.examples_per_query} paths "
        f"{'x3 (+, -, clean: curvature weights)' if cfg.probe_weights == 'curvature' else 'x2'} ({cfg.parallel}), "
        f"seq {cfg.seq_len}, "
        f"backend {cfg.backend}, base weights {cfg.quantize} ..."
    )
    emitted = lowering.store(lower(step, cfg, progress, memory_mb), out_pte, start.store, start.tokenizer)
    manifest = write_manifest(model_dir, cfg, step, emitted, out_pte, start.seconds())
    if init_adapter is not None:
        manifest = start_from_adapter(out_pte, init_adapter)
    progress(
        f"wrote {out_pte} ({manifest.pte.size} B), {manifest.ptd.file} ({manifest.ptd.size} B) "
        f"in {manifest.export_seconds} s"
    )
    return manifest


def write_manifest(
    model_dir: Path, cfg: ProgramConfig, step: MobileMPLoRA, emitted: lowering.Emitted, out_pte: Path, seconds: float
) -> ProgramManifest:
    """The manifest of the program ``emitted`` (``lowering.store``'s files) at ``out_pte``, written beside it."""
    from shared.files import atomic_write_bytes

    manifest = ProgramManifest(
        format=FORMAT_VERSION,
        model=str(Path(model_dir).resolve()),
        config=cfg,
        methods=cfg.methods,
        lora=step.lora.modules,
        lora_size=step.lora.size,
        inputs=_input_spec(cfg),
        pte=emitted.pte,
        ptd=emitted.ptd,
        tokenizer=emitted.tokenizer,
        memory_mb=memory_estimate_mb(emitted, cfg.backend),
        export_seconds=round(seconds, 2),
    )
    atomic_write_bytes(manifest_path(out_pte), manifest.to_json())
    return manifest


def _init_b_file(out_pte: Path, init_b: torch.Tensor) -> ProgramFile:
    """The starting B as a B file beside the program (``FILE.init.safetensors``), named in the manifest."""
    from shared.b_file import b_file_bytes
    from shared.files import atomic_write_bytes

    path = atomic_write_bytes(init_b_path(out_pte), b_file_bytes(init_b.numpy()))
    return program_file(path)


def memory_estimate_mb(emitted: lowering.Emitted, backend: str) -> int:
    """RAM a device needs to train with the program, read from what was emitted: its files, a second copy of the
    weights where XNNPACK packs them for the loaded ``forward`` (the ``.ptd`` is mapped, the packed copy is
    allocated), and the memory plan of the methods a training session loads (all but ``evaluate``, which the agent
    loads in a session of its own afterwards, with less planned memory than ``forward``).

    Measured on SmolLM2-135M (q = 4, batch 16, seq 64, float32, XNNPACK, a 2-core x86-64 VM): a fresh process that
    loads the session and runs one step peaks at 1,115 MB RSS; this gives 1,146 MB (the former formula of
    activations with "50 % headroom" gave 654 MB). An estimate for the server's lease filter, not a guarantee.
    """
    weight_copies = 2 if backend == "xnnpack" else 1
    training = sum(size for method, size in emitted.planned.items() if method != "evaluate")
    total = emitted.pte.size + weight_copies * emitted.ptd.size + max(training, emitted.planned.get("evaluate", 0))
    return int(total / 2**20) + 1


def _input_spec(cfg: ProgramConfig) -> ProgramInputs:
    rows = cfg.q * cfg.examples_per_query
    private = {"clip": [1], "g_noise": [cfg.q]} if cfg.private else {}
    return ProgramInputs(
        forward={
            "input_ids": [rows, cfg.seq_len],
            "attention_mask": [rows, cfg.seq_len],
            "targets": [rows, cfg.answer_len],
            "seed": [1],
            "lr": [1],
            "eps": [1],
        }
        | private,
        padding="left; answers end at the last column; targets hold the last answer_len tokens or -100",
        widths=cfg.widths,
    )
