"""TRL's SFTTrainer with a PEFT LoRA adapter and tba: one callback, `OffloadCallback()`.

    python examples/trl_sft_lora.py                     # small random Llama, about 20 s on a CPU
    TBA_SPILL_DIR=/local_nvme/tba python examples/trl_sft_lora.py
    TBA_ENABLED=0 python examples/trl_sft_lora.py       # off, code untouched

Nothing is downloaded: the model is a Llama built from a small config with random weights, the
tokenizer a character-level one built here, and the data a small in-memory `datasets.Dataset`.
SFTTrainer is a transformers Trainer, so tba's Hugging Face callback applies as it is: each
training forward is one tba step. With LoRA the base weights are frozen, so autograd saves the
activations (offloaded) and the LoRA inputs, not the weights' gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download here

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from tba.integrations.hf import OffloadCallback  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz ."


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of LETTERS, plus <pad>, <s> and </s>."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({c: i + 4 for i, c in enumerate(LETTERS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def sentences(n: int) -> Dataset:
    """Short sentences counting words of a few letters: a text a small model can learn."""
    g = torch.Generator().manual_seed(0)
    words = ["ab", "cd", "efg", "hij", "klm", "nop", "qrs", "tuv"]
    rows = []
    for _ in range(n):
        first = int(torch.randint(0, len(words), (1,), generator=g))
        rows.append({"text": " ".join(words[(first + k) % len(words)] for k in range(5)) + "."})
    return Dataset.from_list(rows)


def train(
    steps: int = 6,
    batch: int = 4,
    hidden: int = 64,
    layers: int = 4,
    callbacks: list[Any] | None = None,
    output_dir: str | None = None,
) -> tuple[list[float], torch.nn.Module]:
    """``steps`` optimizer steps of two micro-batches each. Returns the logged losses and the
    trained PEFT model."""
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(
            output_dir=output_dir or tmp,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=2,
            max_steps=steps,
            learning_rate=3e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
            max_length=32,
        )
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=sentences(2 * batch * steps),
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=callbacks,
        )
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer.model


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)

    offload = OffloadCallback()  # <- tba: settings from TBA_* variables
    losses, _ = train(args.steps, args.batch, args.hidden, args.layers, callbacks=[offload])
    stats = offload.last_stats or {}
    summary = {
        "losses": losses,
        "offload": offload.offloader is not None,
        "bytes_offloaded": stats.get("bytes_offloaded", 0),
        "bytes_reloaded": stats.get("bytes_reloaded", 0),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
