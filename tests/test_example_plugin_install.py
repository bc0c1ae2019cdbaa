"""The example out-of-tree plug-in (examples/loom-example-plugin), installed by `make setup`, is
discovered through its entry point like any third-party package and its members honour their
families' contracts."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from types import SimpleNamespace

import pytest

from loom import plugins

DIST = "loom-example-plugin"
POLICY = "example_lfu_then_lru"
PROCESSOR = "example_force_token"


@pytest.fixture(autouse=True)
def fresh_registry():
    try:
        distribution(DIST)
    except PackageNotFoundError:
        pytest.fail(f"{DIST} is not installed; run `make setup` (it installs examples/{DIST})")
    plugins.reset_for_tests()
    yield
    plugins.reset_for_tests()


def test_entry_point_is_installed():
    eps = [ep for ep in entry_points(group=plugins.ENTRY_POINT_GROUP) if ep.name == "example"]
    assert len(eps) == 1
    assert eps[0].value == "loom_example_plugin:register"
    assert eps[0].dist.name == DIST


def test_registry_lists_members_with_origin():
    entries = {e.name: e for e in plugins.entries("radix_eviction_policy")}
    assert POLICY in entries
    assert DIST in entries[POLICY].origin
    assert "lru" in entries  # built-ins are still there beside it
    assert entries["lru"].origin == plugins.BUILTIN
    processors = {e.name: e for e in plugins.entries("logits_processor")}
    assert PROCESSOR in processors
    assert DIST in processors[PROCESSOR].origin
    assert "example" not in plugins.failed_plugins()


def test_registering_imports_no_torch():
    # The package root holds only `register` with lazy string targets, so discovery stays cheap.
    code = "import sys, loom_example_plugin; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _node(name, hit_count, last_access_time, creation_time=0.0, priority=0):
    return SimpleNamespace(
        name=name,
        hit_count=hit_count,
        last_access_time=last_access_time,
        creation_time=creation_time,
        priority=priority,
    )


def test_policy_evicts_least_hit_then_least_recent():
    from loom.mem_cache.eviction import RadixEvictionPolicy

    cls = plugins.resolve("radix_eviction_policy", POLICY)
    assert issubclass(cls, RadixEvictionPolicy)
    policy = cls()
    nodes = [
        _node("a", hit_count=3, last_access_time=1.0),
        _node("b", hit_count=1, last_access_time=9.0),
        _node("c", hit_count=1, last_access_time=2.0),
        _node("d", hit_count=0, last_access_time=50.0, creation_time=49.0, priority=10),
        _node("e", hit_count=3, last_access_time=0.5),
    ]
    # By hand: fewest hits first (d: 0; c, b: 1; e, a: 3), ties by older last access first.
    # creation_time and priority play no part in this policy.
    order = [n.name for n in sorted(nodes, key=policy.key)]
    assert order == ["d", "c", "b", "e", "a"]
    # `key` is a pure function of the node's state.
    assert [policy.key(n) for n in nodes] == [policy.key(n) for n in nodes]


def test_processor_leaves_only_forced_token_finite():
    import torch

    from loom.sampling.logits_processor import LogitsProcessor

    cls = plugins.resolve("logits_processor", PROCESSOR)
    assert issubclass(cls, LogitsProcessor)
    proc = cls()
    torch.manual_seed(0)
    logits = torch.randn(4, 8)
    original = logits.clone()
    params = [{"token_id": 5}, {"token_id": 0}, {"token_id": 99}, {"token_id": 7}]
    out = proc(logits, params, [[1, 2], [3], [], [4, 4]])
    assert out.shape == (4, 8)
    for row, forced in [(0, 5), (1, 0), (3, 7)]:
        finite = torch.isfinite(out[row]).nonzero().flatten().tolist()
        assert finite == [forced]
        assert out[row, forced] == original[row, forced]  # the forced logit keeps its value
        assert int(out[row].argmax()) == forced
    # An id outside the vocabulary cannot be forced; that row is left as it was.
    assert torch.equal(out[2], original[2])


@pytest.mark.parametrize(
    "params", [{}, {"token_id": "5"}, {"token_id": 1.0}, {"token_id": -1}, {"token_id": True}]
)
def test_processor_rejects_bad_params(params):
    proc = plugins.resolve("logits_processor", PROCESSOR)()
    with pytest.raises(ValueError, match="token_id"):
        proc.validate_params(params)


def test_processor_accepts_good_params():
    proc = plugins.resolve("logits_processor", PROCESSOR)()
    proc.validate_params({"token_id": 0})
    proc.validate_params({"token_id": 49151})


@pytest.mark.parametrize("allow", ["nonexistent", "", "other,another"])
def test_allow_list_excludes_plugin(monkeypatch, allow):
    monkeypatch.setenv("LOOM_PLUGINS", allow)
    plugins.reset_for_tests()
    assert POLICY not in plugins.names("radix_eviction_policy")
    assert PROCESSOR not in plugins.names("logits_processor")
    assert "lru" in plugins.names("radix_eviction_policy")  # built-ins are not plug-ins
    with pytest.raises(plugins.RegistryError, match="lru"):
        plugins.resolve("radix_eviction_policy", POLICY)


def test_allow_list_naming_plugin_loads_it(monkeypatch):
    monkeypatch.setenv("LOOM_PLUGINS", "other, example")
    plugins.reset_for_tests()
    assert POLICY in plugins.names("radix_eviction_policy")


def test_out_of_tree_architecture_serves_at_parity_with_hf():
    """The plug-in's OlmoForCausalLM (Loom ships no OLMo) is registered by the entry point, and
    the engine serves a checkpoint naming it through it: logits equal HF's OLMo over a paged
    pool, and greedy tokens equal HF's generate alone, batched, chunked and retracted."""
    from transformers import OlmoConfig

    from loom.model_loader.base import resolve_model_class
    from loom.testing import check_model, check_model_engine
    from loom.testing._common import TINY_LLAMA

    entries = {e.name: e for e in plugins.entries("model")}
    assert DIST in entries["OlmoForCausalLM"].origin
    cls = resolve_model_class("OlmoForCausalLM", "loom")
    assert cls.__module__ == "loom_example_plugin.olmo"
    config = OlmoConfig(**TINY_LLAMA, architectures=["OlmoForCausalLM"])
    check_model("OlmoForCausalLM", hf_config=config)
    check_model_engine(config, prompt_lens=(5, 19, 26), max_new_tokens=16, model_impl="loom")
