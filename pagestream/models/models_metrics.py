"""/metrics of a multi-model serve: every loaded model's own series with a `model_name`
label (the served name), and each model's state (pagestream:model_loaded, model_state)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagestream.models.model_entry import ModelState
from pagestream.models.model_registry import ModelRegistry


class ModelsCollector(Collector):
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for entry in self.registry.loaded():
            for family in entry.model.metrics.registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = out
                for s in family.samples:
                    labels = {**s.labels, "model_name": entry.name}  # the served name wins
                    out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
        yield from self._states()

    def _states(self) -> Iterable[Metric]:
        loaded = GaugeMetricFamily(
            "pagestream:model_loaded", "1 while the model is loaded.", labels=["model_name"]
        )
        state = GaugeMetricFamily(
            "pagestream:model_state",
            "The model's state (value 1 on its current state).",
            labels=["model_name", "state"],
        )
        users = GaugeMetricFamily(
            "pagestream:model_requests",
            "Requests holding the model or waiting for its load.",
            labels=["model_name"],
        )
        for entry in self.registry.entries.values():
            loaded.add_metric([entry.name], float(entry.state is ModelState.LOADED))
            for value in ModelState:
                state.add_metric([entry.name, value.value], float(entry.state is value))
            users.add_metric([entry.name], entry.users)
        yield from (loaded, state, users)


class ModelsMetrics:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.prometheus = CollectorRegistry()
        self.prometheus.register(ModelsCollector(registry))

    async def render(self) -> bytes:
        for entry in self.registry.loaded():
            model = entry.model
            await model.metrics.refresh(model.frontend)
        return generate_latest(self.prometheus)
