from __future__ import annotations

import subprocess
import sys

import pytest

import loom
from loom import plugins
from loom.config import ServerArgs
from loom.mem_cache.eviction import RadixEvictionPolicy


@pytest.fixture
def clean_registry():
    plugins.reset_for_tests()
    yield
    plugins.reset_for_tests()


class _Policy(RadixEvictionPolicy):
    def key(self, node):
        return node.creation_time


def test_duplicate_name_raises_unless_override(clean_registry):
    plugins.register("radix_eviction_policy", "mine", _Policy)
    with pytest.raises(plugins.RegistryError, match="already registered"):
        plugins.register("radix_eviction_policy", "mine", _Policy)
    plugins.register(
        "radix_eviction_policy", "mine", "loom.mem_cache.eviction:LRUPolicy", override=True
    )
    assert plugins.resolve("radix_eviction_policy", "mine").__name__ == "LRUPolicy"


def test_builtin_duplicate_also_raises(clean_registry):
    with pytest.raises(plugins.RegistryError, match="lru"):
        plugins.register("radix_eviction_policy", "lru", _Policy)


def test_unknown_name_lists_choices(clean_registry):
    with pytest.raises(plugins.RegistryError) as err:
        plugins.resolve("radix_eviction_policy", "nope")
    msg = str(err.value)
    assert "nope" in msg and "lru" in msg and "example_lfu_then_lru" in msg


def test_unknown_family(clean_registry):
    with pytest.raises(plugins.RegistryError, match="families"):
        plugins.register("not_a_family", "x", _Policy)


def test_lazy_target_is_not_imported_until_resolved(clean_registry):
    plugins.register("schedule_policy", "lazy", "loom_no_such_module:Policy")
    assert "lazy" in plugins.names("schedule_policy")
    with pytest.raises(plugins.RegistryError, match="could not be imported"):
        plugins.resolve("schedule_policy", "lazy")


def test_interface_is_checked(clean_registry):
    plugins.register("schedule_policy", "wrong", _Policy)
    with pytest.raises(plugins.RegistryError, match="does not implement"):
        plugins.resolve("schedule_policy", "wrong")


def test_failed_plugin_is_reported_not_fatal(clean_registry, monkeypatch):
    from importlib import metadata

    class _EP:
        name = "broken"
        value = "broken_plugin:register"
        dist = None

        def load(self):
            raise ImportError("no module named broken_plugin")

    real = metadata.entry_points

    def fake(group=None, **kw):
        eps = list(real(group=group, **kw)) if group else []
        return [*eps, _EP()] if group == plugins.ENTRY_POINT_GROUP else real(group=group, **kw)

    monkeypatch.setattr(metadata, "entry_points", fake)
    assert "lru" in plugins.names("radix_eviction_policy")  # Loom still works
    assert "broken" in plugins.failed_plugins()
    with pytest.raises(plugins.RegistryError, match="broken"):
        plugins.resolve("radix_eviction_policy", "nope")


def test_flag_choices_come_from_registry():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--radix-eviction-policy", "example_lfu_then_lru", "--model-path", "x"])
    assert ns.radix_eviction_policy == "example_lfu_then_lru" and ns.model == "x"
    with pytest.raises(SystemExit):
        parser.parse_args(["--radix-eviction-policy", "nope"])


def test_engine_selects_example_plugins_by_name(engine):
    # The policy is resolved by name at start-up (a bad name fails there) ...
    with loom.Engine(max_total_tokens=2048, radix_eviction_policy="example_lfu_then_lru") as e:
        assert e.radix_eviction_policy.__name__ == "LFUThenLRUPolicy"
        # ... and the example logits processor is picked per request by name.
        forced = 1000
        out = e.generate(
            "Hello",
            {
                "max_new_tokens": 5,
                "temperature": 0.7,
                "custom_logit_processor": "example_force_token",
                "custom_params": {"token_id": forced},
            },
        )
        assert out["output_ids"] == [forced] * 5
    with pytest.raises(plugins.RegistryError, match="example_lfu_then_lru"):
        loom.Engine(max_total_tokens=2048, radix_eviction_policy="no_such_policy")


def test_builtin_disallowed_tokens(engine):
    ids = engine.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    base = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0})
    first = base["output_ids"][0]
    out = engine.generate(
        input_ids=ids,
        sampling_params={
            "max_new_tokens": 4,
            "temperature": 0,
            "custom_logit_processor": {
                "name": "disallowed_tokens",
                "params": {"token_ids": [first]},
            },
        },
    )
    assert out["output_ids"][0] != first


def _loom(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_plugins_lists_example():
    res = _loom("plugins")
    assert res.returncode == 0, res.stderr
    assert "example_lfu_then_lru" in res.stdout and "loom-example-plugin" in res.stdout
    assert "example_force_token" in res.stdout
    res = _loom("plugins", "schedule_policy")
    assert "fcfs" in res.stdout and "lru" not in res.stdout


def test_cli_help_lists_plugin_choices():
    res = _loom("generate", "--help")
    assert res.returncode == 0
    assert "example_lfu_then_lru" in res.stdout
