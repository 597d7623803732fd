"""docs/relay.md documents every RelayConfig field and every stats() key of the relay."""

from __future__ import annotations

import dataclasses
import os

from tba.relay import Relay, RelayConfig, layers_of
from tba.testing import GPT

from .conftest import TINY, adamw, token_batches

PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "relay.md")


def section(title: str) -> str:
    """The text of docs/relay.md's section ``## title``, up to the next section."""
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_relay_page_documents_every_option_and_stats_key():
    options = section("`RelayConfig`")
    for field in dataclasses.fields(RelayConfig):
        assert f"| `{field.name}` |" in options, f"docs/relay.md lacks RelayConfig.{field.name}"
    relay = Relay(layers_of(GPT(TINY)), optimizer=adamw, micro_batches=2)
    relay.step(*token_batches(TINY.vocab, TINY.seq, 4, 1)[0])
    keys = set(relay.stats())
    relay.close()
    stats = section("`stats()`")
    for key in sorted(keys):
        assert f"`{key}`" in stats, f"docs/relay.md does not document stats()['{key}']"
