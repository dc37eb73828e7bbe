"""Random-weight models of real shapes, for benchmarks on machines where no weights can be had.

    python bench/random_models.py [--source DIR] [--out DIR] [--shapes m135r,m1p7r]
                                  [--device auto|cpu|cuda] [--dtype bfloat16] [--tiny]

SOURCE holds smollm2-135m's config.json, tokenizer files and chat template: by default the
prepared model folder ($GUARDSTREAM_CACHE/models/smollm2-135m-instruct-v1, made by `python -m
generation prepare smollm2-135m`), or the `tok/` folder of the offline GPU bundle
(bench/gpu/bundle.sh), which has no weights. Writes OUT/m135r (smollm2-135m's exact
architecture) and OUT/m1p7r (SmolLM2-1.7B's: hidden 2048, 24 layers, 32 heads, 32 KV heads),
each a Hugging Face folder `--model` accepts. Compute per token equals the real models'; the text
is gibberish, and greedy decoding tends to repeat one token for ever (which is why benchmarks of
these models must not depend on the text: see bench/engine.py's greedy/sampling note).

Seeded (torch.manual_seed(0)) so that two machines build the same weights on the same device.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

# The 1.7B shape over smollm2-135m's config: SmolLM2-1.7B-Instruct's config.json values.
SHAPES: dict[str, dict[str, int]] = {
    "m135r": {},
    "m1p7r": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 64,
    },
}
# --tiny (bench/gpu/check.sh's CPU rehearsal): the same folders and tokenizer at a size a busy
# CPU runs in seconds: the rehearsal checks command lines and log lines, not speed.
TINY: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
TOKENIZER_FILES = (
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_source() -> Path:
    """The prepared smollm2-135m folder (converting the GGUF once when it is missing)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from generation import models

    return models.prepare("smollm2-135m")


def build(
    source: Path,
    out: Path,
    shape: str,
    device: torch.device,
    dtype: torch.dtype,
    tiny: bool = False,
) -> Path:
    """Write OUT/shape: random weights (seed 0) of `shape` (or of TINY's size under its name),
    with SOURCE's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((source / "config.json").read_text())
    cfg.update(TINY if tiny else SHAPES[shape])
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    conf = LlamaConfig(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(conf).to(dtype)
    folder = out / shape
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{shape}: {params:.0f} M parameters, {dtype} -> {folder}", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", default=None, help="config + tokenizer folder")
    parser.add_argument("--out", default="bench-models")
    parser.add_argument("--shapes", default="m135r,m1p7r")
    parser.add_argument("--device", default="auto", help="where weights are initialised")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--force", action="store_true", help="rebuild folders that exist")
    parser.add_argument(
        "--tiny", action="store_true", help="every shape at TINY's size (a CPU rehearsal)"
    )
    args = parser.parse_args()
    source = Path(args.source) if args.source else default_source()
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    for shape in [s for s in args.shapes.split(",") if s]:
        if shape not in SHAPES:
            parser.error(f"unknown shape {shape!r} ({', '.join(SHAPES)})")
        if (out / shape / "config.json").is_file() and not args.force:
            print(f"{shape}: {out / shape} exists (--force rebuilds it)", flush=True)
            continue
        build(source, out, shape, device, dtype, args.tiny)
    return 0


if __name__ == "__main__":
    sys.exit(main())
