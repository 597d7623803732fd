"""L2L relay execution: train a model layer by layer, with its weights and optimizer state on an
eager parameter server (EPS) in host memory or on SSD.

    import tba.relay as tr

    relay = tr.Relay(
        tr.layers_of(model),  # embed → blocks → head (LlamaForCausalLM, GPT2LMHeadModel, ...)
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        micro_batches=4,
        config=tr.RelayConfig(eps="ssd", stash="ssd"),  # memory that does not grow with depth
        storage=tba.Config(spill_dir="/local_nvme/tba"),
    )
    for input_ids, labels in loader:
        loss = relay.step(input_ids, labels)
    print(relay.stats())
    relay.close()

Each layer runs over all U micro-batches before the next (forward), and in reverse in the
backward, recomputing from its stashed input; each layer's optimizer step runs on the EPS while
the layer below computes. Parameters and losses equal plain gradient accumulation over the same
micro-batches, bit for bit on the CPU. The package uses tba's configuration, errors and storage
backends, never its offloader; nothing in tba's core imports it.
"""

from __future__ import annotations

from ._config import RelayConfig
from ._errors import RelayConfigError
from ._layers import Layers, default_call
from ._relay import Relay
from .adapters import gpt2_layers, gpt_layers, layers_of, llama_layers

__all__ = [
    "Layers",
    "Relay",
    "RelayConfig",
    "RelayConfigError",
    "default_call",
    "gpt2_layers",
    "gpt_layers",
    "layers_of",
    "llama_layers",
]
