"""README's relay section documents every RelayConfig field and every stats() key."""

from __future__ import annotations

import dataclasses
import os

from tba.relay import Relay, RelayConfig, layers_of
from tba.testing import GPT

from .conftest import TINY, adamw, token_batches

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def relay_section() -> str:
    with open(README) as f:
        text = f.read()
    start = text.index("## Relay (L2L): train layer by layer")
    return text[start : text.index("\n## ", start + 1)]


def test_readme_documents_every_option_and_stats_key():
    text = relay_section()
    for field in dataclasses.fields(RelayConfig):
        assert f"`{field.name}`" in text, f"README does not document RelayConfig.{field.name}"
    relay = Relay(layers_of(GPT(TINY)), optimizer=adamw, micro_batches=2)
    relay.step(*token_batches(TINY.vocab, TINY.seq, 4, 1)[0])
    keys = set(relay.stats())
    relay.close()
    for key in sorted(keys):
        assert f"`{key}`" in text, f"README does not document stats()['{key}']"
