"""How much does the agent add to each training step? The agent's training path vs the bare program step.

Bare: ``ProgramSession.step`` over batches already in memory, nothing else. Agent: ``device_agent.job.train`` —
exactly what ``mobizo agent run`` does between download and upload: resume check, the batches file read per
step, the log line written and flushed, heartbeat progress (a heartbeat thread posting every ``--heartbeat-s``
to an in-process stub server), the progress reporter, a checkpoint (B read back, fsynced) every
``--checkpoint-every`` steps, and the result files at the end. Both run the same program session, on the same
SST-2 batches, in interleaved pairs (bare then agent, agent then bare, ...); the overhead is the median over the
pairs of agent/bare - 1. Target: at most 5%. On a small shared machine that ratio is noisy, so the agent's path is also
timed around a null program (instant steps of the right shapes): that is its bookkeeping alone, per step.

    python -m benchmarks.agent --steps 400 --repeats 5 --out runs/bench_agent.json
    mobizo export --model SMOLLM2_DIR --task sst2 --q 4 --batch-size 8 --seq-len 64 --out runs/smollm2/p.pte
    python -m benchmarks.agent --program runs/smollm2/p.pte --steps 20 --checkpoint-every 10   # a real model
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from device_agent import api
from device_agent.backends import TrainRun
from device_agent.backends.local import LocalBackend
from device_agent.batches import write_batches
from device_agent.et_program import ProgramSession
from device_agent.events import Reporter
from device_agent.heartbeat import Heartbeat
from device_agent.job import AgentContext, JobDir, train
from device_agent.local_data import program_shape, step_batches
from shared.manifest import ProgramManifest
from shared.schemas import FileRef, JobSpec, LeasePublic

LR, EPS, SEED = 0.5, 0.05, 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", type=Path, help="an exported program (FILE.pte, store beside it); else exported")
    parser.add_argument("--model", type=Path, help="model to export (default: a fresh tiny model)")
    parser.add_argument("--q", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each kind (interleaved)")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args()


def program(args: argparse.Namespace, folder: Path) -> tuple[Path, ProgramManifest]:
    """(.pte, manifest): ``--program``, or a fresh export (its .ptd and tokenizer beside it)."""
    from shared.data import answer_len_for
    from shared.hf_models import load_model
    from shared.manifest import ProgramConfig, read_manifest
    from shared.program import export_program
    from shared.tasks import get_task
    from shared.tiny_model import make_tiny_model

    if args.program is not None:
        return args.program, read_manifest(args.program)
    model_dir = args.model or make_tiny_model(folder / "tiny", seed=0)
    answer_len = answer_len_for(get_task("sst2"), load_model(model_dir)[1])
    cfg = ProgramConfig(
        q=args.q, batch_size=args.batch_size, seq_len=args.seq_len, answer_len=answer_len, rank=16, alpha=32.0
    )
    pte = folder / "program.pte"
    return pte, export_program(model_dir, cfg, pte, progress=lambda _: None)


def sst2_batches(manifest: ProgramManifest, tokenizer_file: Path, steps: int, folder: Path) -> list:
    """``steps`` steps of real SST-2 rows (the first 2,000 of the train split), as the agent builds them."""
    from shared.data import load_examples
    from shared.tasks import get_task, task_data_dir
    from shared.tokenizer_file import load_tokenizer_file

    rows = folder / "sst2.jsonl"
    with open(task_data_dir() / "sst2" / "train.jsonl") as f:
        rows.write_text("".join(itertools.islice(f, 2000)))
    tokenizer = load_tokenizer_file(tokenizer_file)
    return list(
        step_batches(load_examples(get_task("sst2"), rows), tokenizer, program_shape(manifest.config), SEED, steps, LR)
    )


def stub_server() -> api.DeviceAPI:
    """Answers every heartbeat at once: the client's share of the work stays in this process, as on a device."""
    answer = {"cancelled": False, "status": "running", "expires_at": "2030-01-01T00:00:00Z"}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    return api.DeviceAPI(api.client("http://stub", "token", transport=transport))


def lease_for(manifest: ProgramManifest, steps: int) -> LeasePublic:
    cfg = manifest.config
    spec = JobSpec(
        task="sst2",
        q=cfg.q,
        batch_size=cfg.batch_size,
        steps=steps,
        lr=LR,
        eps=EPS,
        rank=cfg.rank,
        alpha=cfg.alpha,
        seq_len=cfg.seq_len,
        seed=SEED,
        answer_len=cfg.answer_len,
    )
    ref = FileRef(url="/unused", size=manifest.pte.size, sha256=manifest.pte.sha256)
    return LeasePublic(
        job_id=1,
        attempt=1,
        spec=spec,
        manifest=manifest,
        program=ref,
        weights=ref,
        tokenizer=ref,
        expires_at="2030-01-01T00:00:00Z",
        heartbeat_s=60,
    )


class NullProgram:
    """The program's interface with instant steps: what is left of a run is the agent's own work."""

    def __init__(self, manifest: ProgramManifest) -> None:
        q = manifest.config.q
        self.b = np.zeros(manifest.lora_size, np.float32)
        self.losses, self.g = np.full(2 * q, 6.0, np.float32), np.full(q, 0.5, np.float32)

    def get_b(self) -> np.ndarray:
        return self.b.copy()

    def set_b(self, b: np.ndarray) -> None:
        self.b = np.asarray(b, np.float32).copy()

    def step(self, batch, lr: float, eps: float) -> tuple[np.ndarray, np.ndarray]:
        return self.losses.copy(), self.g.copy()


def time_bare(session: ProgramSession, batches: list) -> float:
    session.set_b(np.zeros_like(session.get_b()))
    began = time.perf_counter()
    for batch in batches:
        session.step(batch, float(np.float32(LR)), float(np.float32(EPS)))
    return time.perf_counter() - began


def time_agent(ctx: AgentContext, lease: LeasePublic, run: TrainRun, jobs: JobDir) -> float:
    for path in (jobs.log, jobs.checkpoint, jobs.b_flat, jobs.metrics):
        path.unlink(missing_ok=True)
    began = time.perf_counter()
    with Heartbeat(ctx.api, lease.job_id, ctx.heartbeat_s, ctx.reporter.event) as beat:
        assert train(ctx, lease, run, jobs, beat) == "trained"
    return time.perf_counter() - began


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        pte, manifest = program(args, folder)
        store = pte.parent
        batches = sst2_batches(manifest, store / manifest.tokenizer.file, args.steps, folder)
        write_batches(folder / "b.mzb", program_shape(manifest.config), batches)
        session = ProgramSession(pte, store / manifest.ptd.file, widths=manifest.inputs.widths)
        jobs = JobDir(folder / "job")
        jobs.root.mkdir()
        ctx = AgentContext(
            stub_server(),
            LocalBackend("executorch", lambda run: session),
            folder,
            folder,
            Reporter(io.StringIO(), tty=False),
            checkpoint_every=args.checkpoint_every,
            heartbeat_s=args.heartbeat_s,
        )
        run = TrainRun(
            "bench",
            pte,
            store / manifest.ptd.file,
            manifest,
            folder / "b.mzb",
            float(np.float32(EPS)),
            np.zeros_like(session.get_b()),
            jobs.checkpoint,
            args.checkpoint_every,
        )
        lease = lease_for(manifest, args.steps)
        time_bare(session, batches[:5])  # warm-up
        bare, agent, null = [], [], []
        for i in range(args.repeats):  # pairs, each kind first in every other pair
            for kind in ("bare", "agent")[:: 1 if i % 2 == 0 else -1]:
                if kind == "bare":
                    bare.append(time_bare(session, batches))
                else:
                    agent.append(time_agent(ctx, lease, run, jobs))
        ctx.backend = LocalBackend("null", lambda run: NullProgram(manifest))
        for _ in range(args.repeats):
            null.append(time_agent(ctx, lease, run, jobs))
    report(args, manifest, bare, agent, null)


def report(
    args: argparse.Namespace, manifest: ProgramManifest, bare: list[float], agent: list[float], null: list[float]
) -> None:
    b, a, n = (statistics.median(times) / args.steps for times in (bare, agent, null))
    overhead = statistics.median(x / y - 1 for x, y in zip(agent, bare))
    result = {
        "program": str(args.program or args.model or "tiny"),
        "model": manifest.model,
        "config": manifest.config.model_dump(mode="json"),
        "steps": args.steps,
        "repeats": args.repeats,
        "checkpoint_every": args.checkpoint_every,
        "heartbeat_s": args.heartbeat_s,
        "bare_step_ms": 1000 * b,
        "agent_step_ms": 1000 * a,
        "overhead": overhead,
        "bookkeeping_step_ms": 1000 * n,
        "bookkeeping_share": n / b,
        "bare_s": bare,
        "agent_s": agent,
        "null_s": null,
    }
    print(f"{'':>34}{'ms/step':>10}   (median of {args.repeats} runs of {args.steps} steps)")
    print(f"{'bare program step':>34}{1000 * b:>10.3f}")
    print(f"{'agent training path':>34}{1000 * a:>10.3f}   overhead {100 * overhead:+.1f}% (target <= 5%)")
    print(f"{'agent bookkeeping (null program)':>34}{1000 * n:>10.3f}   = {100 * n / b:.1f}% of a bare step")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
