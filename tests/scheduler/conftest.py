import pytest

from services.common.config import CacheConfig, SchedulerConfig
from services.scheduler.scheduler import Scheduler
from tests.scheduler.stand_in_worker import StandInWorker


@pytest.fixture
def build():
    """build(num_blocks, block_size=16, num_cpu_blocks=0, caching=True, **scheduler_config)."""

    def _build(num_blocks, block_size=16, num_cpu_blocks=0, caching=True, **config):
        config.setdefault("max_model_len", 2048)
        scheduler = Scheduler(
            SchedulerConfig(**config),
            CacheConfig(block_size=block_size, enable_prefix_caching=caching),
            num_device_blocks=num_blocks,
            num_cpu_blocks=num_cpu_blocks,
        )
        worker = StandInWorker(num_blocks, block_size, num_cpu_blocks)
        return scheduler, worker

    return _build
