import pytest

from services.common.config import CacheConfig, ModelConfig, SchedulerConfig, parse_size


def test_parse_size():
    assert parse_size("4GiB") == 4 * 1024**3
    assert parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(1024) == 1024
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_size("four gigs", "kv_cache_memory")


@pytest.mark.parametrize(
    ("factory", "kwargs", "field"),
    [
        (CacheConfig, {"block_size": 12}, "block_size"),
        (CacheConfig, {"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        (CacheConfig, {"kv_cache_memory": 0}, "kv_cache_memory"),
        (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
        (SchedulerConfig, {"preemption_mode": "drop"}, "preemption_mode"),
        (SchedulerConfig, {"policy": "lifo"}, "policy"),
        (
            SchedulerConfig,
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 100},
            "max_num_batched_tokens",
        ),
        (ModelConfig, {"dtype": "float8"}, "dtype"),
        (ModelConfig, {"attention_backend": "flash"}, "attention_backend"),
    ],
)
def test_invalid_config_names_the_field(factory, kwargs, field):
    with pytest.raises(ValueError, match=field):
        factory(**kwargs)


def test_configs_are_frozen():
    config = SchedulerConfig()
    with pytest.raises(AttributeError):
        config.max_num_seqs = 3  # type: ignore[misc]
