"""The native runner's generate mode: the same greedy tokens as the inference program in the Python runtime."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch

from device_agent.checkpoint import save_b
from device_agent.inference import InferenceSession
from shared.generation import Sampling, generate


def _runner(runner_binary, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(runner_binary), "generate", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("with_b", [False, True])
def test_runner_generates_the_python_runtimes_greedy_tokens(runner_binary, tiny_inference, tmp_path, with_b):
    """Same .pte, same kernels (the runner and the pybindings link the same libraries): the same tokens exactly."""
    pte, manifest, store, _ = tiny_inference
    ptd = store / manifest.ptd.file
    b = np.random.default_rng(1).normal(0, 0.5, manifest.lora_size).astype(np.float32) if with_b else None
    session = InferenceSession(pte, ptd, manifest)
    session.set_b(b)
    prompt = torch.randint(3, manifest.vocab_size, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    want = [g.token for g in generate(session, prompt, 20, Sampling())]
    args = ["--program", str(pte), "--data", str(ptd), "--prompt-ids", ",".join(map(str, prompt))]
    args += ["--max-new-tokens", "20"]
    if with_b:
        save_b(tmp_path / "b.f32", b)
        args += ["--b", str(tmp_path / "b.f32")]
    done = _runner(runner_binary, *args)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [x["token"] for x in lines] == want and all(x["seconds"] > 0 for x in lines)
    stopped = _runner(runner_binary, *args, "--stop-ids", str(want[3]))
    assert [json.loads(line)["token"] for line in stopped.stdout.splitlines()] == want[: want.index(want[3]) + 1]


def test_runner_generate_bad_arguments_exit_2(runner_binary, tiny_inference):
    pte, manifest, store, _ = tiny_inference
    done = _runner(
        runner_binary,
        "--program",
        str(pte),
        "--data",
        str(store / manifest.ptd.file),
        "--prompt-ids",
        "1,x",
        "--max-new-tokens",
        "3",
    )
    assert done.returncode == 2 and "--prompt-ids" in done.stderr
