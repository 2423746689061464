"""Do two programs of one model predict alike? Zero-shot accuracy, held-out loss and prediction agreement.

Each program (e.g. the float32 one and the 8da4w one, ``mobizo export --quantize``) is run by the ExecuTorch
runtime with B = 0 through its own ``evaluate`` method, exactly as a device evaluates
(``device_agent.evaluation.predict``). Accuracy near 50% on SST-2's 872 validation examples has a standard error
of 1.7 points, too coarse to compare two programs by; the fraction of examples on which both predict the same
label, and the held-out loss, are not.

    python -m benchmarks.quantized_eval --programs A.pte B.pte --task sst2 --eval FILE [--limit N] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from shared.manifest import read_manifest


def program_predictions(pte: Path, rendered: list) -> tuple[list[int], list[int], float]:
    """(predictions, labels, loss) of one program with B = 0 on rendered examples."""
    from device_agent.et_program import ProgramSession
    from device_agent.evaluation import predict
    from device_agent.local_data import program_shape
    from shared.tokenizer_file import load_tokenizer_file

    manifest = read_manifest(pte)
    session = ProgramSession(pte, pte.parent / manifest.ptd.file, widths=manifest.inputs.widths)
    session.set_b(np.zeros(manifest.lora_size, np.float32))
    tokenizer = load_tokenizer_file(pte.parent / manifest.tokenizer.file)
    config = manifest.config
    return predict(session, rendered, tokenizer, program_shape(config), config.candidates, config.prior)


def main(argv: list[str] | None = None) -> int:
    from shared.data import load_examples
    from shared.tasks import get_task

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", nargs=2, type=Path, required=True, metavar="FILE.pte", help="the two programs")
    parser.add_argument("--task", required=True, help="a built-in task (sst2, rte, boolq, ...)")
    parser.add_argument("--eval", required=True, type=Path, metavar="FILE", help="held-out examples (JSON Lines)")
    parser.add_argument("--limit", type=int, help="the first N examples only")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    rendered = load_examples(get_task(args.task), args.eval, limit=args.limit)
    results = [program_predictions(pte, rendered) for pte in args.programs]
    (first, labels, _), (second, _, _) = results
    figures = {
        "n": len(labels),
        "same_prediction": sum(a == b for a, b in zip(first, second, strict=True)) / len(labels),
        "programs": [
            {
                "program": str(pte),
                "accuracy": sum(p == y for p, y in zip(pred, labels, strict=True)) / len(labels),
                "loss": loss,
            }
            for pte, (pred, _, loss) in zip(args.programs, results, strict=True)
        ],
    }
    if args.json:
        print(json.dumps(figures))
        return 0
    for entry in figures["programs"]:
        print(f"{entry['program']}: accuracy {entry['accuracy']:.4f}, loss {entry['loss']:.4f}")
    print(f"same prediction on {figures['same_prediction']:.4f} of {figures['n']} examples")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
