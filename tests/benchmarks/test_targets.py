"""benchmarks/targets.py on the tiny model: each kind's figures are what their definitions give, computed another way
(the Hessian of one kind built column by column), and a set's figures are the sums of its kinds'."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import targets as bench
from shared.hf_models import load_model
from shared.lora import inject_lora


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path):
    model, tokenizer = load_model(tiny_model_dir)
    lora = inject_lora(model, ("k_proj", "v_proj"), rank=1, alpha=2.0)
    args = bench.parse_args(["--task", "sst2", "--n-examples", "8", "--batch-size", "4", "--seq-len", "32"])
    return model, lora, bench.batches(args, tokenizer)


def test_each_kind_measures_its_gradient_and_its_hessian_trace(tiny) -> None:
    model, lora, data = tiny
    probes = 64
    kinds = {k.name: k for k in bench.measure(model, lora, data, probes=probes, seed=0)}
    masks = bench.masks(lora)
    assert set(kinds) == {"k_proj", "v_proj"} and sum(k.size for k in kinds.values()) == lora.size

    # |G|^2 and E|grad_b|^2 from each batch's gradient, taken here one batch at a time.
    grads = []
    for batch in data:
        leaf = lora.zeros().requires_grad_(True)
        with torch.enable_grad():
            grads.append(torch.autograd.grad(bench.loss_at(model, lora, batch, leaf), leaf)[0])
    mean = torch.stack(grads).mean(dim=0)  # equal batches: the mean loss's gradient
    for name, kind in kinds.items():
        mask = masks[name]
        assert math.isclose(kind.grad_sq, float(mean[mask].double().pow(2).sum()), rel_tol=1e-5)
        assert math.isclose(
            kind.batch_grad_sq, sum(float(g[mask].double().pow(2).sum()) for g in grads) / len(data), rel_tol=1e-5
        )

    # tr H of v_proj, exactly: the diagonal of its Hessian, one Hessian-vector product per coordinate, per batch.
    mask = masks["v_proj"]
    exact = []
    for batch in data:
        leaf = lora.zeros().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(bench.loss_at(model, lora, batch, leaf), leaf, create_graph=True)
            diagonal = [
                torch.autograd.grad(grad[i], leaf, retain_graph=True)[0][i] for i in mask.nonzero().flatten().tolist()
            ]
        exact.append(float(torch.stack(diagonal).sum()))
    trace = sum(exact) / len(exact)
    v = kinds["v_proj"]
    # Hutchinson is unbiased: the estimate is within 5 standard errors of the exact trace (a 1-in-10^6 miss).
    assert abs(v.trace - trace) <= 5 * v.trace_se + 1e-4 * abs(trace)


def test_a_set_sums_its_kinds_and_the_command_prints_both(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    argv = ["--model", str(tiny_model_dir), "--n-examples", "8", "--batch-size", "4", "--probes", "4"]
    argv += ["--targets", "k_proj,v_proj", "--sets", "k_proj,v_proj", "v_proj", "--json-out", str(tmp_path / "t.json")]
    assert bench.main(argv) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    kinds = {k["name"]: k for k in result["kinds"]}
    both, v_alone = result["sets"]
    assert both["size"] == kinds["k_proj"]["size"] + kinds["v_proj"]["size"]
    for field in ("grad_sq", "batch_grad_sq", "trace"):
        assert math.isclose(both[field], kinds["k_proj"][field] + kinds["v_proj"][field], rel_tol=1e-12)
    assert v_alone["grad_sq"] == kinds["v_proj"]["grad_sq"]
    printed = capsys.readouterr().out
    assert "| k_proj,v_proj |" in printed and "| v_proj |" in printed
