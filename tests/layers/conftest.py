"""Fixtures for the tba.layers tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These tests use tiny tensors, where a second intra-op thread only adds synchronisation;
    on a loaded 2-CPU machine it made the training tests 10x slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
