"""Does the gradient estimate survive quantization?

With int8 dynamic activations the effect of ±eps·z on a loss is of the order of the activation-quantization noise,
and the projected gradient g = (L+ - L-) / (2 eps) is exactly that difference. For the same seeds, batches (SST-2
train, in the agent's order) and B, this script compares g of quantized step modules with the float32 step: the
fraction of g's with the same sign and their correlation, at each eps. B follows the float32 run (trained at the
first eps); every variant starts each step from that B.

Variants: ``8da4w`` (torchao, eager), ``4w`` (int4 groupwise weights, float activations, eager only, as the
paper's NF4), and with ``--program`` an 8da4w ``.pte`` of the same shapes run by the ExecuTorch runtime (the
device's kernels).

    python -m benchmarks.quantization --model DIR [--q 4 --batch-size 8 --seq-len 64 --steps 50]
        [--eps 1e-2 1e-3 1e-1] [--program FILE.pte] [--out runs/quantization.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from shared.manifest import ProgramConfig, read_manifest

VARIANTS = ("8da4w", "4w")


def sst2_batches(tokenizer, cfg: ProgramConfig, steps: int, seed: int) -> list:
    """The batches an agent would train on: the first 1,000 SST-2 train examples (the paper's low-data regime) in
    ``shared.data.batch_indices`` order."""
    from shared.data import batch_indices, encode, load_examples, pad_token_id, training_batch
    from shared.tasks import get_task, task_data_dir

    examples = encode(
        load_examples(get_task("sst2"), task_data_dir() / "sst2" / "train.jsonl", limit=1000), tokenizer, cfg.seq_len
    )
    pad = pad_token_id(tokenizer)
    rows = [batch_indices(len(examples), cfg.batch_size, seed, k) for k in range(steps)]
    return [training_batch([examples[i] for i in r], pad, cfg.seq_len, cfg.answer_len) for r in rows]


def agreement(g: torch.Tensor, reference: torch.Tensor) -> dict:
    """Sign agreement and Pearson correlation of two sets of projected gradients (float64)."""
    g, reference = g.double().flatten(), reference.double().flatten()
    corr = torch.corrcoef(torch.stack([g, reference]))[0, 1]
    return {"sign_agreement": float((g.sign() == reference.sign()).double().mean()), "correlation": float(corr)}


def measure(model_dir: Path, cfg: ProgramConfig, steps: int, eps_list: list[float], lr: float, program: Path | None):
    """{eps: {variant: g [steps, q]}} with ``none`` the float32 reference."""
    from shared.data import answer_len_for
    from shared.hf_models import load_model
    from shared.program import build_step_module
    from shared.quantize import quantize_base
    from shared.tasks import get_task

    modules = {}
    for variant in ("none", *VARIANTS):
        model, tokenizer = load_model(model_dir, "float32")
        modules[variant] = build_step_module(model, cfg.model_copy(update={"quantize": "none"}))
        quantize_base(modules[variant].model, variant, cfg.group_size)
    if program is None:
        cfg = cfg.model_copy(update={"answer_len": answer_len_for(get_task("sst2"), tokenizer)})
    runtime = _program_methods(program) if program is not None else None
    names = [*modules, *(["pte-8da4w"] if runtime else [])]
    g = {eps: {name: [] for name in names} for eps in eps_list}
    b = torch.zeros_like(modules["none"].lora_b)
    for k, batch in enumerate(sst2_batches(tokenizer, cfg, steps, seed=0)):
        inputs = [batch.input_ids, batch.attention_mask, batch.targets, torch.tensor([k]), torch.tensor([lr])]
        next_b = b
        for eps in eps_list:
            for name, module in modules.items():
                with torch.no_grad():
                    module.lora_b.copy_(b)
                    g[eps][name].append(module(*inputs, torch.tensor([eps]))[1].clone())
                if name == "none" and eps == eps_list[0]:
                    next_b = module.lora_b.clone()
            if runtime:
                runtime["set_lora_b"].execute([b])
                g[eps]["pte-8da4w"].append(runtime["forward"].execute([*inputs, torch.tensor([eps])])[1].clone())
        b = next_b
        print(f"step {k + 1}/{steps}", file=sys.stderr)
    return {eps: {name: torch.stack(gs) for name, gs in by_name.items()} for eps, by_name in g.items()}


def _program_methods(pte: Path) -> dict:
    from executorch.runtime import Runtime

    manifest = read_manifest(pte)
    loaded = Runtime.get().load_program(pte, data_path=pte.parent / manifest.ptd.file)
    return {m: loaded.load_method(m) for m in ("forward", "set_lora_b")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--q", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-2, 1e-3, 1e-1], help="the first trains B")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--program", type=Path, help="an 8da4w .pte, run by the ExecuTorch runtime (its config wins)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = ProgramConfig(
        q=args.q, batch_size=args.batch_size, seq_len=args.seq_len, answer_len=1, group_size=args.group_size
    )
    if args.program is not None:  # its shapes, rank and targets
        cfg = read_manifest(args.program).config
    g = measure(args.model, cfg, args.steps, args.eps, args.lr, args.program)
    rows = [
        {"eps": eps, "variant": name, **agreement(values, by_name["none"]), "n": values.numel()}
        for eps, by_name in g.items()
        for name, values in by_name.items()
        if name != "none"
    ]
    print(f"{'eps':>8} {'variant':>10} {'sign agreement':>15} {'correlation':>12} {'n':>5}")
    for row in rows:
        print(
            f"{row['eps']:>8g} {row['variant']:>10} {row['sign_agreement']:>15.3f} "
            f"{row['correlation']:>12.3f} {row['n']:>5}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
