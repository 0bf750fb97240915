"""Shared test models: random-init HF checkpoints made by transformers from the real configs, shrunk."""

from __future__ import annotations

import pytest

from mconvert.synthetic import add_mtp_layers, make_hf_checkpoint, real_config, shrink


@pytest.fixture(scope="session", autouse=True)
def class_verdict_cache(tmp_path_factory):
    """The exports of the whole session keep what transformers' class holds (converters/class_verdicts.py) in one
    directory of its own, never the user's, set before any fixture exports (module- and session-scoped ones too): a
    config's class is built once in the session (seconds each), and a kept verdict refuses what the class would
    (tests/test_class_verdicts.py shows each refusal)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MCONVERT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture
def empty_verdict_cache(tmp_path_factory, monkeypatch):
    """A directory of the test's own, empty at its start, for a test whose export must build the class itself (in a
    child process, or to keep the first verdict)."""
    monkeypatch.setenv("MCONVERT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def hf_model_factory(tmp_path_factory):
    """make(name, layers, max_shard_size, seed, mtp, weight_std, fused_experts, **config overrides) -> directory of a
    shrunk random-init HF checkpoint (cached per args; make_hf_checkpoint says what weight_std and fused_experts do);
    mtp: with the multi-token prediction layers its config names (add_mtp_layers), in a directory of its own, so
    that the checkpoint without them stays as made."""
    made = {}

    def make(
        config_name: str, layers: int = 2, max_shard_size: str | None = None, seed: int = 0, mtp: bool = False,
        weight_std: float = 0.05, fused_experts: bool = False, **overrides,
    ):
        key = (config_name, layers, max_shard_size, seed, mtp, weight_std, fused_experts, repr(sorted(overrides.items())))  # values may be lists
        if key not in made:
            out = tmp_path_factory.mktemp(config_name.replace(".", "_"))
            made[key] = make_hf_checkpoint(
                shrink(real_config(config_name), layers=layers, **overrides), out / "hf", seed=seed, max_shard_size=max_shard_size,
                weight_std=weight_std, fused_experts=fused_experts,
            )
            if mtp:
                add_mtp_layers(made[key])
        return made[key]

    return make
