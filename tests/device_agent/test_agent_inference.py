"""`mobizo agent generate` and `mobizo agent eval` against a real server: the device fetches the inference program
(found in the server's cache, seeded with the suite's ``tiny_inference``: the server's compile of it is
tests/server/test_inference.py's subject), the model's weights file and its adapter's B, and agrees with the host's
eager PyTorch + PEFT (`mobizo eval`, `mobizo generate`) on the adapter the device itself trained."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mobizo.cli import main
from tests.device_agent.stack import Agent, Stack, agent_env
from tests.server.live import REPO
from tests.utils.program_cache import seed_server_inference
from tests.utils.tolerance import loss_rtol

pytestmark = pytest.mark.slow

TEMPLATE = "Review: {sentence} It was"  # not the task's own: the adapter's card carries it
ANSWERS = {"0": " terrible", "1": " great"}  # the task's own


@pytest.fixture(scope="module")
def trained(
    live_server, local_data: Path, tiny_model_dir: Path, tiny_inference, tmp_path_factory: pytest.TempPathFactory
):
    """The session's live server, an enrolled device that trained an adapter on local SST-2, and that adapter as
    PEFT files."""
    tmp = tmp_path_factory.mktemp("agent-inference")
    pte, manifest, _, _ = tiny_inference  # the program the device asks for: its default context, the jobs' LoRA
    seed_server_inference(live_server[1], tiny_model_dir, pte, manifest)
    stack = Stack(*live_server, tmp, tiny_model_dir)
    job_id = stack.submit(steps=10, template=TEMPLATE, verbalizer=ANSWERS)  # the task's answers: its program
    agent = Agent(stack.enroll(), tmp / "work", local_data, tmp / "agent.log", ["--poll-s", "0.2"])
    assert agent.start().wait() == 0, agent.tail()
    adapter_id = stack.adapter(job_id)["id"]
    yield stack, agent, adapter_id, stack.download_adapter(job_id, tmp / "adapter"), local_data / "sst2" / "train.jsonl"


def _agent(agent: Agent, *args: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        "-m",
        "mobizo",
        "agent",
        *args,
        "--config",
        str(agent.config),
        "--work-dir",
        str(agent.work),
    ]
    return subprocess.run(argv, env=agent_env(), capture_output=True, text=True, timeout=1200, cwd=REPO)


def test_agent_eval_agrees_with_mobizo_eval(trained, tiny_model_dir, capsys):
    """Same examples, same scoring: accuracy equal, loss within the model's float32 rounding bound
    (tests/utils/tolerance.py) relative to the loss."""
    stack, agent, adapter_id, adapter_dir, data = trained
    flags = ["--task", "sst2", "--data", str(data), "--limit", "24", "--json"]
    shown = stack.user.get(f"/v1/adapters/{adapter_id}").raise_for_status().json()
    assert shown["prompt"]["template"] == TEMPLATE and shown["prompt"]["objective"] == "classification"
    device = _agent(agent, "eval", "--adapter-id", str(adapter_id), *flags)
    assert device.returncode == 0, device.stderr
    assert f"the prompt the adapter was trained with: {TEMPLATE!r}" in device.stderr  # the card's, by default
    assert main(["eval", "--model", str(tiny_model_dir), "--adapter", str(adapter_dir), *flags]) == 0
    host = json.loads(capsys.readouterr().out.splitlines()[-1])
    got = json.loads(device.stdout.splitlines()[-1])
    assert got["n"] == host["n"] == 24 and got["accuracy"] == host["accuracy"]
    from transformers import AutoConfig

    atol = loss_rtol(AutoConfig.from_pretrained(tiny_model_dir)) * host["loss"]
    assert abs(got["loss"] - host["loss"]) <= atol
    cached = sorted(p.suffix for p in (agent.work / "cache").iterdir())
    assert cached.count(".ptd") == 1  # the training program's weights file serves inference too
    builtin = _agent(agent, "eval", "--adapter-id", str(adapter_id), *flags, "--prompt", "builtin")
    assert builtin.returncode == 0 and "trained with" not in builtin.stderr, builtin.stderr
    assert json.loads(builtin.stdout.splitlines()[-1])["loss"] != got["loss"]  # another prompt, another loss


def test_agent_generate_agrees_with_mobizo_generate_where_decisive(trained, tiny_model_dir, capsys):
    """Greedy tokens of the device equal the host's at every step whose top-2 margin exceeds twice the bound."""
    from peft import PeftModel

    from shared.data import prompt_token_ids
    from shared.generation import EagerStepper, Sampling, generate
    from shared.hf_models import load_model

    stack, agent, adapter_id, adapter_dir, _ = trained
    flags = ["--prompt", "The movie was", "--max-new-tokens", "16", "--json"]
    device = _agent(agent, "generate", "--adapter-id", str(adapter_id), *flags)
    assert device.returncode == 0, device.stderr
    lines = [json.loads(x) for x in device.stdout.splitlines()]
    assert lines[-1]["event"] == "done" and lines[-1]["decode_tokens_per_s"] > 0
    got = [x["token"] for x in lines[:-1]]
    model, tokenizer = load_model(tiny_model_dir)
    eager = PeftModel.from_pretrained(model, adapter_dir).eval()
    stepper, decisive = EagerStepper(eager), []

    def recording(tokens, pos):
        logits = stepper(tokens, pos)
        top2 = torch.topk(logits, 2).values
        decisive.append(float(top2[0] - top2[1]) > 2 * loss_rtol(model.config) * float(logits.abs().max()))
        return logits

    ids = prompt_token_ids(tokenizer, "The movie was")
    want = [g.token for g in generate(recording, ids, 16, Sampling(), frozenset({tokenizer.eos_token_id}))]
    compared = list(itertools.takewhile(lambda t: t[2], zip(got, want, decisive)))
    assert compared and all(a == b for a, b, _ in compared)


@pytest.mark.parametrize("backend", ["adb", "native"])
def test_the_runner_backends_generate_what_the_python_runtime_generates(trained, runner_binary, tmp_path, backend):
    """The native runner's generate mode, on the phone (adb: the stand-in) or on this machine (native), picks the
    same greedy tokens as the ExecuTorch runtime in this process: same program, same kernels."""
    import os

    from tests.device_agent.conftest import ADB_STANDIN_DIR

    _, agent, adapter_id, _, _ = trained
    flags = ["generate", "--adapter-id", str(adapter_id), "--prompt", "It was", "--max-new-tokens", "12", "--json"]
    here = _agent(agent, *flags)
    env = {
        "MOBIZO_FAKE_DEVICE_ROOT": str(tmp_path / "phone"),
        "PATH": f"{ADB_STANDIN_DIR}{os.pathsep}{os.environ['PATH']}",
    }
    argv = [sys.executable, "-m", "mobizo", "agent", *flags, "--backend", backend, "--runner", str(runner_binary)]
    argv += ["--config", str(agent.config), "--work-dir", str(agent.work)]
    device = subprocess.run(argv, env=agent_env(env), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert here.returncode == 0 and device.returncode == 0, here.stderr + device.stderr
    tokens = [[json.loads(x).get("token") for x in run.stdout.splitlines()[:-1]] for run in (here, device)]
    assert tokens[0] == tokens[1] and len(tokens[0]) > 0
    store = tmp_path / "phone/data/local/tmp/mobizo/store" if backend == "adb" else agent.work / "native" / "store"
    assert sorted(p.suffix for p in store.iterdir()) == [".ptd", ".pte"]  # where the runner read the program


def test_the_merged_download_is_the_adapter_folded_into_its_base(trained, tiny_model_dir, tmp_path, capsys):
    """``GET /v1/adapters/{id}/merged``: built on the compile queue (503 + Retry-After until it is, which the CLI
    waits through), a zip of a plain model folder whose weights are bit for bit what
    ``mobizo adapters merge`` folds on the host from the downloaded adapter (whose logits that command's own test
    checks against PEFT); then served by its ETag; a dtype it does not write is a 422 naming it."""
    import io
    import zipfile

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    stack, _, adapter_id, adapter_dir, _ = trained
    key = stack.user.headers["authorization"].split()[1]
    building = stack.user.get(f"/v1/adapters/{adapter_id}/merged")  # the first request starts the merge
    assert building.status_code == 503 and int(building.headers["retry-after"]) >= 1, building.text
    cli = ["adapters", "download", str(adapter_id), "--merged", "--server", stack.url, "--token", key]
    assert main([*cli, "--out", str(tmp_path / "served")]) == 0  # mobizo's own client: waits, fetches, unpacks
    r = stack.user.get(f"/v1/adapters/{adapter_id}/merged")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip", r.text
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert sorted(zf.namelist()) == sorted(p.name for p in (tmp_path / "served").iterdir())
    host = tmp_path / "host"
    assert (
        main(["adapters", "merge", "--model", str(tiny_model_dir), "--adapter", str(adapter_dir), "--out", str(host)])
        == 0
    )
    capsys.readouterr()
    served, folded = load_file(tmp_path / "served" / "model.safetensors"), load_file(host / "model.safetensors")
    assert served.keys() == folded.keys() and all(torch.equal(served[k], folded[k]) for k in folded)
    AutoModelForCausalLM.from_pretrained(tmp_path / "served", local_files_only=True)  # a plain model: it loads
    again = stack.user.get(f"/v1/adapters/{adapter_id}/merged", headers={"If-None-Match": r.headers["etag"]})
    assert again.status_code == 304  # found in the store, not merged again
    wrong = stack.user.get(f"/v1/adapters/{adapter_id}/merged", params={"dtype": "int8"})
    assert wrong.status_code == 422 and wrong.json()["detail"][0]["loc"] == ["query", "dtype"]


def test_the_merged_model_runs_on_the_device_with_no_adapter(trained, tmp_path, capsys):
    """The merged folder registered as a model of its own: the device's inference program of that model, at B = 0,
    scores as the base's program with the adapter's B does (accuracy equal, loss within the float32 bound)."""
    from transformers import AutoConfig

    from tests.server.factories import ADMIN_TOKEN

    stack, agent, adapter_id, _, data = trained
    key = stack.user.headers["authorization"].split()[1]
    out = tmp_path / "merged"
    cli = ["adapters", "download", str(adapter_id), "--merged", "--server", stack.url, "--token", key]
    assert main([*cli, "--out", str(out)]) == 0
    capsys.readouterr()
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    registered = stack.user.post("/v1/models", json={"name": "tiny-merged", "path": str(out)}, headers=admin)
    assert registered.status_code == 201, registered.text
    flags = ["--task", "sst2", "--data", str(data), "--limit", "24", "--json", "--template", TEMPLATE]
    flags += ["--verbalizer", json.dumps(ANSWERS)]
    with_adapter = _agent(agent, "eval", "--adapter-id", str(adapter_id), *flags)
    folded = _agent(agent, "eval", "--model", "tiny-merged", *flags)
    assert with_adapter.returncode == 0 and folded.returncode == 0, folded.stderr
    want, got = (json.loads(run.stdout.splitlines()[-1]) for run in (with_adapter, folded))
    assert got["n"] == want["n"] == 24 and got["accuracy"] == want["accuracy"]
    bound = loss_rtol(AutoConfig.from_pretrained(out)) * want["loss"]
    assert abs(got["loss"] - want["loss"]) <= bound
    base = _agent(agent, "eval", "--model", "tiny", *flags)  # the base alone, to show the adapter moved the loss
    assert abs(json.loads(base.stdout.splitlines()[-1])["loss"] - want["loss"]) > 10 * bound, base.stderr
