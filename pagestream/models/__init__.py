"""Many models behind one `pagestream serve`: each model its own AsyncEngine (an engine-core
process), loaded on first use and unloaded when idle (ModelRegistry), reached through one
HTTP app that routes each request by its `model` field (ModelDispatcher)."""
