"""Does the inference program compute what eager PyTorch + PEFT computes, on a real model? The checks of
``tests/shared/test_inference_program.py`` (run there on the tiny model) for any model and exported program, base
and one random adapter:

- teacher-forced: a ``--prefill``-token prefill, then one-token decode steps through the KV cache up to
  ``--tokens``; the largest |logit difference| against PEFT on the whole sequence, next to the bound the tests use
  (``tests/utils/tolerance.loss_rtol``: (layers + 2)·n_max·u relative, times the largest |logit|);
- greedy decoding of ``--new-tokens`` tokens from a text prompt: how many steps pick eager's token before the first
  difference, and the smallest top-2 margin among them (a real model's worst-case bound is too loose to call any
  step decisive, so the margin says how close the closest agreeing call was).

    python -m benchmarks.inference_agreement --model /tmp/inf/smol --program /tmp/inf/prog/inference.pte \\
        --training-manifest /tmp/inf/prog/train.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from device_agent.inference import InferenceSession
from shared.adapter import save_program_adapter
from shared.generation import EagerStepper, Sampling, generate
from shared.hf_models import load_model
from shared.manifest import ProgramManifest, read_inference_manifest
from tests.utils.tolerance import loss_rtol

PROMPT = "The movie was a quiet, patient portrait of a family, and by the end I"


def _eager(model_dir: Path, adapter: Path | None):
    from peft import PeftModel

    model, _ = load_model(model_dir)
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def teacher_forced(session, eager, ids: torch.Tensor, prefill: int) -> tuple[float, float]:
    """(largest |difference|, the bound) over every position after the prefill and the decode steps."""
    with torch.no_grad():
        want = eager(input_ids=ids).logits[0]
    got = [session.logits(ids[:, :prefill], torch.arange(prefill))[0]]
    got += [session.logits(ids[:, p : p + 1], torch.tensor([p]))[0] for p in range(prefill, ids.shape[1])]
    got = torch.cat(got)
    return float((got - want).abs().max()), loss_rtol(eager.config) * float(want.abs().max())


def greedy(session, eager, prompt: list[int], new_tokens: int) -> tuple[int, int, float]:
    """(steps whose token is eager's before the first difference, steps generated, the smallest top-2 margin among
    those steps): the worst-case bound is too loose on a real model to call any step decisive, so the margin says
    how close the closest agreeing call was."""
    device = [g.token for g in generate(session, prompt, new_tokens, Sampling())]
    stepper, margins = EagerStepper(eager), []

    def recording(tokens, pos):
        logits = stepper(tokens, pos)
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        return logits

    reference = [g.token for g in generate(recording, prompt, new_tokens, Sampling())]
    agreed = 0
    for mine, theirs in zip(device, reference, strict=True):
        if mine != theirs:
            break
        agreed += 1
    return agreed, len(device), min(margins[:agreed], default=float("nan"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--program", required=True, type=Path, help="the inference program (its .ptd beside it)")
    p.add_argument("--training-manifest", required=True, type=Path, help="a training program's manifest (A layout)")
    p.add_argument("--prefill", type=int, default=24)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--b-scale", type=float, default=0.05, help="the random adapter's B ~ N(0, 1)·scale")
    args = p.parse_args()
    manifest = read_inference_manifest(args.program)
    train = ProgramManifest.model_validate_json(args.training_manifest.read_bytes())
    session = InferenceSession(args.program, args.program.parent / manifest.ptd.file, manifest)
    _, tokenizer = load_model(args.model)
    prompt = tokenizer(PROMPT)["input_ids"]
    b = torch.randn(manifest.lora_size, generator=torch.Generator().manual_seed(1)) * args.b_scale
    with tempfile.TemporaryDirectory() as tmp:
        adapter = save_program_adapter(Path(tmp), train, b, args.model.name)
        print("| adapter | max abs logit diff | bound | diff / bound | greedy: same tokens | smallest top-2 margin |")
        print("|---|---|---|---|---|---|")
        for name, path, flat in (("base", None, None), (f"random B × {args.b_scale}", adapter, b)):
            eager = _eager(args.model, path)
            session.set_b(None if flat is None else flat.numpy())
            seeded = torch.Generator().manual_seed(0)
            ids = torch.randint(3, eager.config.vocab_size, (1, args.tokens), generator=seeded)
            diff, bound = teacher_forced(session, eager, ids, args.prefill)
            agreed, total, margin = greedy(session, eager, prompt, args.new_tokens)
            cells = f"{diff:.3g} | {bound:.3g} | {diff / bound:.2g} | {agreed} of {total} | {margin:.3g}"
            print(f"| {name} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
