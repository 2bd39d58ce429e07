"""The composition root builds each component from its own sub-config."""

import pytest

from agents.compose import (
    build_engine,
    env_factory,
    image_limits,
    place_beside_learner,
    proxy_config,
    sampling_params,
    serve_policy,
    split_cpus,
)
from agents.config import EngineConfig, EnvConfig, ModelConfig, SamplingConfig, ServeSection
from agents.engines.embedded import EmbeddedEngine
from agents.engines.remote import RemoteEngine
from agents.store import Store
from agents.trajectory import TurnType
from agents.vision import ImageLimits


def test_the_embedded_engine_is_built_from_its_config():
    config = EngineConfig(threads=1, max_batch=4, prefix_cache_tokens=100)
    engine = build_engine(config, ModelConfig("tiny", max_images=5))
    try:
        assert isinstance(engine, EmbeddedEngine) and engine.policy_version == 0
        assert engine.image_limits == ImageLimits(max_images=5)
        assert engine._scheduler.prefixes.max_tokens == 100
        reply = engine.generate([{"role": "user", "content": "hi"}])
        assert reply.completion_token_ids and len(reply.completion_logprobs) == len(
            reply.completion_token_ids
        )
    finally:
        engine.close()


def test_a_remote_engine_takes_its_url_and_key():
    config = EngineConfig(backend="remote", base_url="http://127.0.0.1:9/v1", api_key="k")
    engine = build_engine(config, ModelConfig("served-name"))
    try:
        assert isinstance(engine, RemoteEngine)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "config, fragment",
    [
        (EngineConfig(backend="tgi"), "engine=embedded"),
        (EngineConfig(backend="remote"), "engine.base_url"),
        (EngineConfig(backend="vllm", max_loras=1), "max_loras"),
        (EngineConfig(backend="vllm", gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (EngineConfig(prefix_cache_tokens=-1), "prefix_cache_tokens must be >= 0"),
    ],
)
def test_an_engine_config_that_cannot_serve_says_the_fix(config, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_engine(config, ModelConfig("tiny"))


def test_envs_and_sampling_come_from_their_sections():
    make = env_factory(EnvConfig(id="clawgym/Arith-v0", kwargs={"max_turns": 2}))
    first, second = make(), make()
    assert first is not second and first.unwrapped.max_turns == 2
    sampling = sampling_params(SamplingConfig(temperature=0.0, top_p=0.9, max_tokens=7), seed=3)
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens, sampling.seed) == (
        0.0,
        0.9,
        7,
        3,
    )


def test_the_proxy_takes_its_section_and_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("CLAWGYM_API_KEY", "from-env")
    config = proxy_config(
        ServeSection(turn_type="side", max_tokens=9), ModelConfig("tiny"), env_id="bench"
    )
    assert (config.api_key, config.default_turn_type, config.max_tokens, config.env_id) == (
        "from-env",
        TurnType.SIDE,
        9,
        "bench",
    )
    monkeypatch.delenv("CLAWGYM_API_KEY")
    assert proxy_config(ServeSection(api_key="given"), ModelConfig("tiny")).api_key == "given"


def test_the_models_image_limits_reach_the_proxy_and_bad_ones_say_the_fix():
    model = ModelConfig("tiny-vl", max_image_bytes=1000, max_images=2)
    config = proxy_config(ServeSection(), model)
    assert config.image_limits() == image_limits(model) == ImageLimits(1000, 2)
    assert proxy_config(ServeSection(), ModelConfig("tiny")).image_limits() == ImageLimits()
    with pytest.raises(ValueError, match="model.max_image_bytes and model.max_images"):
        image_limits(ModelConfig("tiny-vl", max_images=0))


def test_a_vision_language_model_on_vllm_is_refused_saying_the_fix():
    with pytest.raises(ValueError, match="engine=embedded"):
        build_engine(EngineConfig(backend="vllm"), ModelConfig("tiny-vl"))


def test_serve_policy_serves_on_a_free_port_and_refuses_an_open_bind_without_key(
    tiny_engine, tmp_path, monkeypatch
):
    monkeypatch.delenv("CLAWGYM_API_KEY", raising=False)
    with Store(tmp_path / "s.sqlite") as store:
        with serve_policy(tiny_engine, store, ServeSection(port=0), ModelConfig("tiny")) as (
            url,
            proxy,
        ):
            assert url.startswith("http://127.0.0.1:") and proxy.engine is tiny_engine
        with pytest.raises(ValueError, match="api_key"):
            with serve_policy(
                tiny_engine, store, ServeSection(host="0.0.0.0", port=0), ModelConfig("tiny")
            ):
                pass


@pytest.mark.parametrize(
    ("cpus", "share", "learner", "engine"),
    [
        ([0, 1], None, [0], [1]),
        ([0, 1, 2, 3, 4], None, [0, 1], [2, 3, 4]),
        ([0, 1, 2, 3], 1, [0, 1, 2], [3]),
        ([0, 1], 5, [0], [1]),  # the learner always keeps a core
        ([3], None, [3], [3]),  # one core: both share it
        ([5, 2, 7], None, [2], [5, 7]),
    ],
)
def test_a_cpu_machine_splits_its_cores_between_learner_and_vllm(cpus, share, learner, engine):
    assert split_cpus(cpus, share) == (learner, engine)


def test_only_vllm_beside_a_cpu_learner_takes_cores_of_its_own(monkeypatch):
    import agents.engines.vllm_command

    monkeypatch.setattr(agents.engines.vllm_command, "own_cpus", lambda: [0, 1, 2, 3])
    vllm = EngineConfig(backend="vllm", threads=1)
    assert place_beside_learner(vllm, learner_on_cpu=True) == ([0, 1, 2], [3])
    # alternating phases never compute at once: each takes every core
    every = [0, 1, 2, 3]
    assert place_beside_learner(vllm, learner_on_cpu=True, overlap=False) == (every, every)
    assert place_beside_learner(vllm, learner_on_cpu=False) == (None, None)
    assert place_beside_learner(EngineConfig(), learner_on_cpu=True) == (None, None)
