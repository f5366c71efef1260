"""Build a tiny random-weight Llama and its tokenizer, offline and deterministically.

Run with the vLLM environment's interpreter (it has torch, transformers and tokenizers)::

    ~/.cache/pd-sidecar/vllm/venv/bin/python e2e/make_tiny_model.py --out DIR

The model is no language model: its weights are random (seeded). It exists so that two real vLLM
engines can run prefill and decode on a CPU in seconds and produce *prompt-dependent, deterministic*
text, which is all the end-to-end suite needs: greedy text through prefill → NIXL → decode must
equal a plain run on the decode engine.

Shape choices, and why:
- head size 32 (hidden 128 / 4 heads): vLLM's CPU attention backend supports 32, 64, 80, ... but
  not 16;
- max positions 4096 so that prompts of a few thousand tokens (30+ KV blocks of 128) fit;
- weights drawn with a larger spread than the usual 0.02 so that next-token logits are far apart:
  with near-flat logits, the last-bit differences between computing the prompt's last token in a
  prefill pass and in a decode step (bf16) could flip a greedy choice;
- a byte-level BPE tokenizer of 500 tokens trained on generated ASCII text, with a trivial chat
  template; its alphabet is only the corpus's characters (not all 256 bytes), so that every token
  decodes to readable text (other bytes become ``<unk>``).

The same seed gives byte-identical files (checked by ``--check``, which builds twice).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 20261129
VOCAB_SIZE = 500
MAX_POSITIONS = 4096
INIT_STD = 0.2

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2, as LlamaConfig expects
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TEXT = (
    "the a of to and in is on for with as by at from that this it be are was were prefill decode "
    "cache block token tokens engine engines transfer memory layer head attention model serve "
    "request requests stream proxy sidecar pod node queue batch latency throughput remote local "
    "time first byte last key value tensor weight random tiny test prompt answer text word line "
    "north south east west river mountain city garden window morning evening light stone paper "
    "apple orange green blue red yellow quick slow bright quiet open closed small large new old "
    "one two three four five six seven eight nine ten hundred thousand"
)
WORDS = TEXT.split()


def corpus(rng: random.Random, sentences: int = 20_000) -> list[str]:
    """Generated pseudo-English with punctuation, digits, newlines and the chat template's role
    tags, for training the tokenizer."""
    lines = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "?", "!", ","])
        if rng.random() < 0.1:
            sentence = f"<|{rng.choice(['user', 'assistant', 'system'])}|>\n{sentence}\n"
        lines.append(sentence)
    return lines


def build(out: Path, seed: int = SEED) -> None:
    # The vLLM environment's packages, not the sidecar's: unknown to the sidecar's mypy.
    import torch  # type: ignore[import-not-found, unused-ignore]
    from tokenizers import (  # type: ignore[import-not-found, unused-ignore]
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import (  # type: ignore[import-not-found, unused-ignore]
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    rng = random.Random(seed)
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    backend.train_from_iterator(corpus(rng), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=MAX_POSITIONS,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def digest(directory: Path) -> str:
    """One hash over every file's name and bytes."""
    total = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        total.update(path.relative_to(directory).as_posix().encode())
        total.update(path.read_bytes())
    return total.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    parser.add_argument(
        "--check", action="store_true", help="build a second copy and require identical bytes"
    )
    args = parser.parse_args()
    build(args.out)
    summary = {"model": str(args.out), "sha256": digest(args.out)}
    if args.check:
        with tempfile.TemporaryDirectory() as scratch:
            build(Path(scratch))
            if digest(Path(scratch)) != summary["sha256"]:
                sys.exit("make_tiny_model: two builds with the same seed differ")
        summary["deterministic"] = "yes"
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
