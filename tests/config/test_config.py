"""tba.Config: env and argument precedence, sizes, collected errors, unknown variables."""

from __future__ import annotations

import os
import re
import warnings

import pytest

import tba
from tba import config as config_mod
from tba.config import Config, format_size, parse_size
from tba.errors import ValueParseError


def test_defaults_without_env():
    c = Config(environ={})
    assert c.enabled is True and c.backend == "auto" and c.keep_last == "auto"
    assert c.min_offload_bytes == 1 << 20 and c.max_disk_bytes is None
    assert c.spill_dir.startswith("/var/tmp/tba-") and c.rank == 0
    assert all(v == "default" for v in c.sources.values())


def test_every_field_has_an_env_variable():
    names = {f.name for f in config_mod.dataclasses.fields(Config)} - {"sources", "environ"}
    described = {name for name, env, _, _ in Config.describe()}
    assert names == described
    for _, env, _, text in Config.describe():
        assert env.startswith("TBA_") and text


def test_env_is_read_and_arguments_win():
    env = {
        "TBA_STAGING_BYTES": "64MiB",
        "TBA_KEEP_LAST": "3",
        "TBA_BACKEND": "Memory",
        "TBA_ENABLED": "yes",
        "TBA_SPILL_DIR": "/nvme/x",
        "TBA_MAX_DISK_BYTES": "1.5GiB",
    }
    c = Config(environ=env, keep_last=2)
    assert c.staging_bytes == 64 << 20 and c.keep_last == 2 and c.backend == "memory"
    assert c.spill_dir == "/nvme/x" and c.max_disk_bytes == 3 << 29
    assert c.sources["keep_last"] == "argument" and c.sources["staging_bytes"] == "env"


@pytest.mark.parametrize(
    "text,want",
    [
        ("4096", 4096),
        (4096, 4096),
        ("64MiB", 64 << 20),
        ("64 mib", 64 << 20),
        ("1GiB", 1 << 30),
        ("1.5GB", 1_500_000_000),
        ("4k", 4096),
        ("2M", 2 << 20),
        ("1TiB", 1 << 40),
        ("10B", 10),
    ],
)
def test_sizes_accept_units(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["lots", "12XB", "-1", -1, 1.5, True, None])
def test_a_bad_size_is_a_typed_config_error(bad):
    # A ValueError and a ConfigError both, so callers can catch exactly this and nothing else
    with pytest.raises(ValueParseError, match=r"tba.config: .* is invalid; expected a size") as e:
        parse_size(bad)
    assert isinstance(e.value, ValueError) and isinstance(e.value, tba.ConfigError)
    assert e.value.value == bad and e.value.expected.startswith("a size")


def test_format_size():
    assert format_size(64 << 20) == "64.0 MiB" and format_size(12) == "12 B"


@pytest.mark.parametrize(
    "env,match",
    [
        ({"TBA_STAGING_BYTES": "12XB"}, r"TBA_STAGING_BYTES='12XB' is invalid; expected a size"),
        (
            {"TBA_STAGING_BYTES": "1KiB"},
            r"TBA_STAGING_BYTES='1KiB' is invalid; expected a size of at least 1.0 MiB",
        ),
        ({"TBA_IO_THREADS": "0"}, r"TBA_IO_THREADS='0' is invalid; expected a whole number >= 1"),
        (
            {"TBA_KEEP_LAST": "-1"},
            r"TBA_KEEP_LAST='-1' is invalid; expected 'auto' or a whole number >= 0",
        ),
        ({"TBA_KEEP_LAST": "two"}, r"TBA_KEEP_LAST='two' is invalid"),
        (
            {"TBA_BACKEND": "nvme"},
            r"TBA_BACKEND='nvme' is invalid; expected one of auto\|native\|posix",
        ),
        ({"TBA_ENABLED": "maybe"}, r"TBA_ENABLED='maybe' is invalid; expected 1 or 0"),
        ({"TBA_CHECKSUM": "md5"}, r"TBA_CHECKSUM='md5' is invalid; expected one of auto\|off"),
        ({"TBA_LOG_LEVEL": "loud"}, r"TBA_LOG_LEVEL='loud' is invalid; expected one of DEBUG"),
        ({"TBA_MAX_DISK_BYTES": "0"}, r"TBA_MAX_DISK_BYTES='0' is invalid; .*'none' for no quota"),
        ({"TBA_SPILL_DIR": "  "}, r"TBA_SPILL_DIR='  ' is invalid; expected a directory path"),
        ({"TBA_RANK": "-3"}, r"TBA_RANK='-3' is invalid"),
    ],
)
def test_bad_env_values_are_named(env, match):
    with pytest.raises(tba.ConfigError, match=match):
        Config(environ=env)


def test_bad_arguments_are_named():
    with pytest.raises(tba.ConfigError, match=r"io_threads=0 is invalid; expected a whole number"):
        Config(environ={}, io_threads=0)
    with pytest.raises(ValueError, match=r"min_offload_bytes=True is invalid"):
        Config(environ={}, min_offload_bytes=True)


def test_all_problems_in_one_error():
    env = {"TBA_STAGING_BYTES": "x", "TBA_KEEP_LAST": "y"}
    with pytest.raises(tba.ConfigError, match=r"3 problems") as ei:
        Config(environ=env, io_threads=-1)
    assert len(ei.value.problems) == 3


def test_unknown_variable_warns_with_closest_name():
    config_mod._warned_env.discard("TBA_KEEP_LAS")
    with pytest.warns(
        UserWarning, match=r"unknown environment variable TBA_KEEP_LAS .*TBA_KEEP_LAST"
    ):
        Config(environ={"TBA_KEEP_LAS": "2"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config(environ={"TBA_KEEP_LAS": "2"})  # once per process


def test_rank_falls_back_to_torchrun_rank():
    assert Config(environ={"RANK": "3"}).rank == 3
    assert Config(environ={"RANK": "3", "TBA_RANK": "1"}).rank == 1


def test_zero_means_off_for_counts():
    assert Config(environ={"TBA_KEEP_LAST": "0"}).keep_last == 0
    assert Config(environ={"TBA_ENABLED": "0"}).enabled is False


def test_replace_keeps_explicit_arguments():
    c = Config(environ={}, keep_last=4).replace(io_threads=2)
    assert c.keep_last == 4 and c.io_threads == 2


def test_offloader_accepts_overrides(tmp_path):
    off = tba.Offloader(spill_dir=str(tmp_path), backend="memory", min_free_bytes=0)
    assert off.config.backend == "memory" and off.stats()["backend"] == "memory"
    off.close()


def test_environment_is_every_variable_tba_reads(monkeypatch):
    monkeypatch.setenv("TBA_STAGING_BYTES", "64MiB")
    monkeypatch.setenv("TBA_NOT_A_SETTING", "1")  # unknown ones too: callers report them
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("HOME_OF_SOMETHING_ELSE", "x")
    got = config_mod.environment()
    assert got["TBA_STAGING_BYTES"] == "64MiB" and got["TBA_NOT_A_SETTING"] == "1"
    assert got["LOCAL_WORLD_SIZE"] == "4" and got["RANK"] == "2"
    assert "HOME_OF_SOMETHING_ELSE" not in got and "PATH" not in got
    assert set(config_mod.OTHER_ENV) >= {"RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"}
    config_mod._warned_env.discard("TBA_NOT_A_SETTING")
    with pytest.warns(UserWarning, match="unknown environment variable TBA_NOT_A_SETTING"):
        assert Config(environ=got, backend="memory").staging_bytes == 64 << 20


def test_config_is_the_only_reader_of_the_environment():
    root = os.path.dirname(os.path.abspath(tba.__file__))
    readers = re.compile(r"os\.environ|os\.getenv|\benviron\.get\b|os\.getenvb")
    found = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if name.endswith(".py") and path != os.path.join(root, "config", "__init__.py"):
                with open(path) as f:
                    found += [f"{path}:{n}" for n, ln in enumerate(f, 1) if readers.search(ln)]
    assert found == []


@pytest.mark.parametrize(
    "raw, want",
    [
        ("0.35", 0.35),
        ("35%", 0.35),
        (" 1.0 ", 1.0),
        (0.5, 0.5),
        ("2GiB", 2 << 30),
        (64 << 20, 64 << 20),
        ("none", None),
        ("", None),
    ],
)
def test_memory_budget_is_a_fraction_or_bytes(raw, want):
    assert budget_config(raw).memory_budget == want
    assert Config(environ={}).memory_budget is None


def budget_config(raw):
    """TBA_MEMORY_BUDGET from the environment (a string) or as an argument (anything else)."""
    if isinstance(raw, str):
        return Config(environ={"TBA_MEMORY_BUDGET": raw})
    return Config(environ={}, memory_budget=raw)


@pytest.mark.parametrize("raw", ["1", "0", "1.5", "0%", "abc", "-0.2", "512KiB", True])
def test_bad_memory_budget_is_a_config_error_naming_the_fix(raw):
    with pytest.raises(tba.ConfigError, match="MEMORY_BUDGET|memory_budget") as got:
        budget_config(raw)
    assert "such as 0.35" in str(got.value) and "2GiB" in str(got.value)
