"""The agent's on-device inference: fetch what is missing (cached by sha256), load a base once, swap adapters.

``LocalModels`` asks the server (device token, no lease) for an adapter's model and LoRA layout, the inference
program of that layout and the adapter's B; files land in the work folder's content cache, shared with training
(the weights ``.ptd`` is the training programs' own, so a device that trained there already holds it). One
``InferenceSession`` per program stays loaded for the life of the object: switching adapters of the same layout
is a ``set_lora_b``, never a reload of the base.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from device_agent.api import DeviceAPI
from device_agent.download import ContentCache
from device_agent.inference import InferenceSession
from shared import defaults
from shared.b_file import read_b_file
from shared.manifest import InferenceConfig, InferenceManifest
from shared.retry import RetryPolicy, call_with_retry
from shared.schemas import AdapterPublic, blob_url


@dataclass(frozen=True)
class Fetched:
    """An inference program's files in the cache, and the B to run it with (None: the base)."""

    key: str
    manifest: InferenceManifest
    pte: Path
    ptd: Path
    tokenizer: Path
    b: np.ndarray | None
    adapter: AdapterPublic | None = None  # the adapter B comes from, with how it must be prompted


class LocalModels:
    def __init__(self, api: DeviceAPI, cache_dir: Path, policy: RetryPolicy, max_context: int = defaults.MAX_CONTEXT):
        self.api, self.cache, self.policy, self.max_context = api, ContentCache(cache_dir), policy, max_context
        self._sessions: dict[str, InferenceSession] = {}

    def _call(self, fn, *args):
        return call_with_retry(self.policy, fn, *args)

    def _fetch(self, ref, suffix: str) -> Path:
        return self.cache.fetch(self.api.http, ref.url, ref.sha256, suffix, ref.size, self.policy)

    def _program(self, model: str, rank: int, alpha: float, targets, a_seed: int, b) -> Fetched:
        config = InferenceConfig(
            max_context=self.max_context, rank=rank, alpha=alpha, targets=tuple(targets), a_seed=a_seed
        )
        served = self._call(self.api.inference_program, model, config)
        pte, ptd = self._fetch(served.program, ".pte"), self._fetch(served.weights, ".ptd")
        return Fetched(served.key, served.manifest, pte, ptd, self._fetch(served.tokenizer, ".json"), b)

    def adapter(self, adapter_id: int) -> Fetched:
        """The program for the adapter's model and LoRA layout, and the adapter's B (all fetched once, by sha256)."""
        found = self._call(self.api.adapter, adapter_id)
        url = blob_url(found.b_sha256)
        path = self.cache.fetch(self.api.http, url, found.b_sha256, ".b.safetensors", None, self.policy)
        fetched = self._program(found.model, found.rank, found.alpha, found.targets, found.a_seed, None)
        return replace(fetched, b=read_b_file(path, fetched.manifest.lora_size), adapter=found)

    def base(self, model: str) -> Fetched:
        """The base model (B = 0) through the program of the default LoRA layout."""
        return self._program(model, defaults.RANK, defaults.ALPHA, defaults.TARGETS, defaults.A_SEED, None)

    def session(self, fetched: Fetched) -> InferenceSession:
        """The program loaded in this process (once per program) and set to ``fetched.b``."""
        if fetched.key not in self._sessions:
            self._sessions[fetched.key] = InferenceSession(fetched.pte, fetched.ptd, fetched.manifest)
        session = self._sessions[fetched.key]
        session.set_b(fetched.b)
        return session


class ProgramAsModel:
    """The inference program behind the call ``shared.evaluate`` makes of a Hugging Face model, so ``agent eval``
    scores exactly as ``mobizo eval`` does: each left-padded row runs alone from position 0 (no padding reaches
    the program), and its logits land where the padded batch would have them."""

    training = False

    def __init__(self, session: InferenceSession) -> None:
        import torch

        self.session = session
        self._anchor = torch.zeros(1)

    def parameters(self):
        return iter([self._anchor])

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self

    def __call__(self, input_ids, attention_mask, position_ids, logits_to_keep: int):
        from types import SimpleNamespace

        import torch

        rows = input_ids.shape[0]
        out = torch.zeros(rows, logits_to_keep, self.session.manifest.vocab_size)
        for i in range(rows):
            tokens = input_ids[i][attention_mask[i].bool()]
            logits = self.session.logits(tokens[None], torch.arange(tokens.numel()))[0]
            keep = min(logits_to_keep, tokens.numel())
            out[i, logits_to_keep - keep :] = logits[tokens.numel() - keep :]
        return SimpleNamespace(logits=out)
