"""A tiny random GPT-2 with a locally trained byte-level BPE tokenizer, for fast tests.

Every code path of the engine (chat template, EOS, multi-byte characters split across tokens)
is real; only the text is gibberish. The build is deterministic: a fixed corpus, a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

SEED = 1234
VOCAB_SIZE = 1024
CONTEXT = 512
EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
# Peaked logits (large weights) keep argmax far from ties, so batched, padded and prefill-vs-decode
# arithmetic (which differ in the last bits) never flip a greedy choice.
INITIALIZER_RANGE = 0.25

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Streaming guardrails hold text back until every detector has judged it.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Contact me at jo@example.com or call 555-0100 tomorrow morning.",
    "Cats are small carnivorous mammals. Dogs are loyal companions.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159",
    "Émilie a mangé une crème brûlée à Zürich. Straße, façade, naïve, señor.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 😀 😃 🎉 🚀 ❤️ 👍 🐍 🌍 — and symbols: € £ ¥ © ™ ≤ ≥ ∞.",
    "def hello(name):\n    return f'Hello, {name}!'\n",
    "<|im_start|>user\nTell me about cats.<|im_end|>\n<|im_start|>assistant\nCats purr.<|im_end|>\n",
]


def _train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols: any text (emoji, CJK) round-trips through byte tokens.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def build_tiny_random(out_dir: Path) -> None:
    """Write a tokenizer and a seeded random GPT-2 to `out_dir` (a Hugging Face folder)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        eos_token=EOS,
        bos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=CONTEXT,
    )
    fast.chat_template = CHAT_TEMPLATE
    eos_id = fast.convert_tokens_to_ids(EOS)
    config = GPT2Config(
        vocab_size=len(fast),
        n_positions=CONTEXT,
        n_embd=64,
        n_layer=2,
        n_head=2,
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
