"""Hugging Face Trainer with tba: one callback, `OffloadCallback()`.

    python examples/hf_trainer.py                       # small random GPT-2, about 25 s on a CPU
    TBA_SPILL_DIR=/local_nvme/tba python examples/hf_trainer.py
    TBA_ENABLED=0 python examples/hf_trainer.py         # off, code untouched

The model is GPT-2 built from a small config with random weights: nothing is downloaded. The
callback wraps the model's forward for the length of train(): each training forward is one tba
step, and the backward that Trainer runs through accelerate reads the activations back.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download here

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from tba.integrations.hf import OffloadCallback  # noqa: E402


class CountingSequences(torch.utils.data.Dataset):
    """Sequences that count up by a fixed stride: a next-token task the model can learn."""

    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--output-dir", default=None)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=args.seq,
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    offload = OffloadCallback()  # <- tba: settings from TBA_* variables
    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp,
            per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=2,
            max_steps=args.steps,
            learning_rate=3e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=CountingSequences(4 * args.batch * args.steps, args.seq, 256),
            callbacks=[offload],
        )
        trainer.train()
    stats = offload.last_stats or {}
    summary = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "offload": offload.offloader is not None,
        "bytes_offloaded": stats.get("bytes_offloaded", 0),
        "bytes_reloaded": stats.get("bytes_reloaded", 0),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
