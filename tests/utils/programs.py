"""The program configs the suite shares (each is exported once per session by the ``program_factory`` fixture)."""

from pathlib import Path

from shared.manifest import ProgramConfig

# The tiny model's device programs: one query with the language-modelling objective, 16 columns of which the last 2
# are answers, rank 2 (another LoRA layout than the rest: programs of every layout share the model's .ptd); four
# queries, E = 2, with the classification objective over SST-2's answers (" terrible", " great" are the tiny
# tokenizer's tokens 392 and 373: the program a server compiles for an SST-2 job by default).
TINY_Q1 = ProgramConfig(q=1, batch_size=2, seq_len=16, answer_len=2, rank=2, alpha=4.0)
TINY_Q4 = ProgramConfig(
    q=4,
    batch_size=8,
    seq_len=16,
    answer_len=1,
    rank=4,
    alpha=8.0,
    objective="classification",
    candidates=(392, 373),
)
# A job (``JobCreate`` fields, without its steps) whose program a server resolves to ``TINY_Q4``: the end-to-end
# tests' servers find it compiled (``tests.utils.program_cache.seed_server_program``), so one export serves them all.
TINY_Q4_JOB = {
    "model": "tiny",
    "task": "sst2",
    "q": 4,
    "batch_size": 8,
    "seq_len": 16,
    "rank": 4,
    "alpha": 8.0,
    "lr": 0.5,
    "eps": 0.05,
    "seed": 3,
}
# The same four-query program with 4-bit groupwise base linears and int8 dynamic activations (shared.quantize).
TINY_Q4_8DA4W = TINY_Q4.model_copy(update={"quantize": "8da4w"})
# The same program with each optimizer that keeps a state (shared.zo_optim): its buffer beside B. The normalized one
# at 4 columns: its one test exports it from the one-layer model (its subject is the optimizer, not the width); it is
# also calibrated (a prior per candidate in its loss, shared.calibration: values of float32, far from the tiny
# model's own, so the prior moves every loss).
TINY_Q4_MOMENTUM = TINY_Q4.model_copy(update={"optimizer": "momentum"})
TINY_Q4_NORMALIZED = TINY_Q4.model_copy(update={"optimizer": "normalized", "seq_len": 4, "prior": (-0.25, -3.5)})
# A personal job on the user's own text (the ``text`` task: a row per line, the tiny tokenizer's lines of the
# shipped Shakespeare sample take up to 34 tokens), private (DP-ZO): two queries of E = 2 rows, 64 columns of which
# the last 36 are answers, rank 2. The program a server compiles for ``TINY_TEXT_JOB``; its forward's losses are
# the language-modelling objective's, so the program = eager test of that objective runs on it too (one export).
TINY_TEXT_JOB = {
    "model": "tiny",
    "task": "text",
    "q": 2,
    "batch_size": 4,
    "seq_len": 64,
    "answer_len": 36,
    "rank": 2,
    "alpha": 4.0,
    "lr": 0.05,
    "eps": 0.05,
    "seed": 3,
    "privacy": {"epsilon": 8.0, "min_examples": 64},
}
TINY_TEXT = ProgramConfig(q=2, batch_size=4, seq_len=64, answer_len=36, rank=2, alpha=4.0, private=True)


def weights_files(folder: Path) -> tuple[set[str], set[str]]:
    """(every .ptd in ``folder``, the .ptd files its float32 XNNPACK programs' manifests name). The session's program
    folder also holds 8da4w programs, whose quantized weights are a file of their own, and may hold portable ones,
    whose weights are stored under other keys than XNNPACK's, so in a file of their own too."""
    import json

    named: set[str] = set()
    for manifest in folder.glob("*.json"):
        data = json.loads(manifest.read_text())
        config = data.get("config", {}) if isinstance(data, dict) and "ptd" in data else None
        if config is not None and (config.get("quantize", "none"), config.get("backend")) == ("none", "xnnpack"):
            named.add(data["ptd"]["file"])
    return {p.name for p in folder.glob("*.ptd")}, named
