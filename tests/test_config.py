"""``ServerArgs``: frozen sections built from flat flag-named arguments, the CLI generated from
them with every flag named as before, and the device defaults in one table."""

import argparse
import dataclasses
import pickle

import pytest

from loom.config import DEVICE_DEFAULTS, SECTIONS, ServerArgs, device_defaults


def test_sections_hold_every_argument_once_and_read_flat():
    names = [f.name for f in ServerArgs.fields()]
    assert len(names) == len(set(names))
    args = ServerArgs(page_size=16, grammar_backend="llguidance", port=8000)
    assert args.page_size == args.cache_args.page_size == 16
    assert args.grammar_args.grammar_backend == "llguidance" and args.port == 8000
    for attr, cls in SECTIONS.items():
        assert isinstance(getattr(args, attr), cls)
        assert dataclasses.is_dataclass(cls)
    assert set(args.to_dict()) == set(names)


def test_frozen_and_equal_by_value_and_picklable():
    args = ServerArgs(page_size=4, lora_paths=["a=/x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.page_size = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.cache_args.page_size = 8
    assert pickle.loads(pickle.dumps(args)) == args
    assert args.replace(page_size=8).page_size == 8 and args.page_size == 4
    assert args.enable_lora  # implied by lora_paths, inside the LoRA section


def test_unknown_and_invalid_arguments_name_the_problem():
    with pytest.raises(TypeError, match="unknown server argument.*pagesize"):
        ServerArgs(pagesize=4)
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        ServerArgs(page_size=0)
    with pytest.raises(ValueError, match="needs the radix cache"):
        ServerArgs(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(AttributeError, match="no argument 'nope'"):
        _ = ServerArgs().nope


def test_cli_flags_round_trip():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    assert flags == {f.name for f in ServerArgs.fields()}
    ns = parser.parse_args(
        ["--page-size", "4", "--model-path", "m.gguf", "--disable-radix-cache", "--port", "1"]
    )
    args = ServerArgs.from_cli_args(ns)
    assert (args.page_size, args.model, args.disable_radix_cache, args.port) == (
        4,
        "m.gguf",
        True,
        1,
    )
    assert ServerArgs.from_cli_args(parser.parse_args([])) == ServerArgs()


def test_device_defaults_are_one_table():
    assert device_defaults("cuda") is DEVICE_DEFAULTS["cuda"]
    assert device_defaults("mps") is DEVICE_DEFAULTS["cpu"]  # unknown devices: the CPU's
    assert DEVICE_DEFAULTS["cuda"].chunked_prefill_size == 8192
    assert DEVICE_DEFAULTS["cpu"].chunked_prefill_size == 1024
