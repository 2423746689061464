"""What the agent computes runs in a device install (``mobizo[device]``: no torch, ExecuTorch or transformers,
simulated by ``tests/utils/device_install``): its batches, the replay behind a resume and the held-out points, a
private job's noise and the held-out figures, each equal, bit for bit, to what the torch path computes here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.device_agent.test_device_install import device_env

pytestmark = pytest.mark.numerics


_DEVICE = """
import json, sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from device_agent.batches import Shape
from device_agent.checkpoint import Checkpoint, save_checkpoint
from device_agent.evaluation import evaluate_points
from device_agent.job import b_at_steps, private_noise
from device_agent.local_data import step_batches
from device_agent.trainlog import LogWriter, resume_point
from shared.data import load_examples
from shared.tasks import get_task
from shared.tokenizer_file import load_tokenizer_file

folder = Path(sys.argv[1])
case = json.loads((folder / "case.json").read_text())
out = {}
tokenizer = load_tokenizer_file(folder / "tokenizer.json")
rendered = load_examples(get_task("sst2"), case["data"], limit=40)
steps = list(step_batches(rendered, tokenizer, Shape(8, 24, 1), 5, 6, 0.05, "cosine", 2, 0.1, (392, 373)))
for k, step in enumerate(steps):
    out[f"batch{k}"] = np.concatenate([step.input_ids, step.attention_mask, step.targets], axis=1)
    out[f"seed{k}"], out[f"lr{k}"] = np.int64(step.seed), np.float32(step.lr)
log, init = case["log"], np.load(folder / "init.npy")
for k, b in b_at_steps(init, log, [0, 4, 10], "normalized"):
    out[f"b_at{k}"] = b
with LogWriter(folder / "log.jsonl") as writer:
    for record in log:
        writer.write(record)
save_checkpoint(folder / "c", Checkpoint("run", 7, init))
start, out["resume_b"], out["resume_state"] = resume_point(folder / "log.jsonl", folder / "c", "run", init, "momentum")
assert start == 7
spec = SimpleNamespace(privacy=SimpleNamespace(**case["privacy"]), batch_size=8, q=4)
noise = private_noise(spec, case["private_seed"])
out["private"] = np.stack([noise(k)[1] for k in range(3)])

class Table:  # a stand-in program: the evaluator's protocol, the figures computed here
    def evaluate_points(self, points, chunks):
        return [np.stack([c[0][:, -2:].astype(np.float32) * b[:1] for c in chunks]) for b in points]

figures = evaluate_points(Table(), [init, init * 2], rendered[:12], tokenizer, Shape(8, 24, 1), "classification",
                          (392, 373))
np.savez(folder / "out.npz", **out)
(folder / "figures.json").write_text(json.dumps(figures))
assert not {m.partition(".")[0] for m in sys.modules} & {"torch", "executorch", "transformers"}
"""


def test_the_device_computes_the_torch_paths_bits_without_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from device_agent.batches import Shape
    from device_agent.evaluation import evaluate_points
    from device_agent.job import private_noise
    from shared.data import batch_indices, encode, load_examples, pad_token_id, training_batch
    from shared.noise import step_seed
    from shared.schedule import lr_at
    from shared.tasks import get_task, task_data_dir
    from shared.tokenizer_file import tokenizer_bytes
    from tests.shared.test_numpy_paths import bits, random_log, torch_steps

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_bytes(tokenizer))
    data = task_data_dir() / "sst2" / "train.jsonl"
    log = random_log("normalized", 10, 4, seed=3)
    init = np.random.default_rng(0).normal(0, 0.1, 300).astype(np.float32)
    np.save(tmp_path / "init.npy", init)
    private = {"clip": 0.5, "noise_multiplier": 1.3}
    case = {"data": str(data), "log": log, "private_seed": 12345, "privacy": private}
    (tmp_path / "case.json").write_text(json.dumps(case))
    run = subprocess.run(
        [sys.executable, "-c", _DEVICE, str(tmp_path)], capture_output=True, text=True, env=device_env()
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")

    # Batches: mobizo train's torch batches (padded to the program's 24 columns) and step seeds.
    rendered = load_examples(get_task("sst2"), data, limit=40)
    encoded = encode(rendered, tokenizer, 24)
    for k in range(6):
        batch = training_batch([encoded[i] for i in batch_indices(40, 8, 5, k)], pad_token_id(tokenizer), 24, 1)
        want = torch.cat([batch.input_ids, batch.attention_mask, batch.targets], dim=1).numpy()
        assert np.array_equal(got[f"batch{k}"], want) and got[f"seed{k}"] == step_seed(5, k)
        assert got[f"lr{k}"] == np.float32(lr_at(0.05, 6, k, "cosine", 2, 0.1))
    # The replay: B at the held-out points, and a resume's B and momentum, as torch's steps give them.
    for k in (0, 4, 10):
        assert np.array_equal(bits(got[f"b_at{k}"]), bits(torch_steps(init, log[:k], "normalized")[0]))
    want_b, want_state = torch_steps(init, log[:7], "momentum")
    assert np.array_equal(bits(got["resume_b"]), bits(init))  # the checkpoint's B: it covers the log
    assert np.array_equal(bits(got["resume_state"]), bits(want_state["m"])) and np.abs(want_b.numpy()).max() > 0
    # A private job's noise: what this process's agent draws from the same seed.
    here = private_noise(SimpleNamespace(privacy=SimpleNamespace(**private), batch_size=8, q=4), 12345)
    assert np.array_equal(bits(got["private"]), bits(np.stack([here(k)[1] for k in range(3)])))

    class Table:
        def evaluate_points(self, points, chunks):
            return [np.stack([c[0][:, -2:].astype(np.float32) * b[:1] for c in chunks]) for b in points]

    shape = Shape(8, 24, 1)
    want = evaluate_points(Table(), [init, init * 2], rendered[:12], tokenizer, shape, "classification", (392, 373))
    assert json.loads((tmp_path / "figures.json").read_text()) == want
