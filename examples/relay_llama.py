"""Train a Llama layer by layer with the L2L relay (tba.relay): weights, optimizer state and the
stashed layer inputs on SSD, so that memory does not grow with the number of layers.

    python examples/relay_llama.py                      # about 30 s on a 2-core CPU
    TBA_SPILL_DIR=/local_nvme/tba python examples/relay_llama.py --layers 16
    python examples/relay_llama.py --eps host --stash memory   # the L2L paper's host EPS

The model is a LlamaForCausalLM built from a small config with random weights: nothing is
downloaded. The data is a next-token task it can learn (each sequence counts up by a fixed
stride), so the loss goes down. Storage settings (spill dir, backend) come from the TBA_*
environment (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download here

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import tba  # noqa: E402
import tba.relay as tr  # noqa: E402
from tba.testing import strided_batches  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--eps", choices=["host", "ssd"], default="ssd")
    p.add_argument("--stash", choices=["memory", "ssd"], default="ssd")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )
    model = LlamaForCausalLM(config)
    relay = tr.Relay(
        tr.layers_of(model),  # embed → decoder layers → norm + lm_head
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        micro_batches=args.micro_batches,
        config=tr.RelayConfig(eps=args.eps, stash=args.stash),
        storage=tba.Config(),  # spill dir and backend from TBA_*
    )

    losses = []
    for x, _ in strided_batches(config.vocab_size, args.seq, args.batch, args.steps):
        loss = relay.step(x, x)  # labels = inputs: the model shifts them
        losses.append(loss.item())
        print(f"step {len(losses):3d}  loss {losses[-1]:.4f}")

    st = relay.stats()
    relay.close()  # with eps="host" the trained weights go back into `model`
    summary = {
        "losses": losses,
        "offload": args.eps == "ssd" or args.stash == "ssd",
        "bytes_offloaded": st["weight_bytes_written"]
        + st["state_bytes_written"]
        + st["stash_bytes_written"],
        "param_bytes": st["param_bytes"],
        "weight_bytes_moved": st["weight_bytes_moved"],
        "peak_working_bytes": st["peak_working_bytes"],
        "eps": st["eps"],
        "stash": st["stash"],
        "backend": st["backend"],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
