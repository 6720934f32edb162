"""Executors: how the engine core runs a step plan on its worker(s).

`Executor` (executor.py) is the protocol the step loop uses; `uni` runs one in-process
worker, `worker_group` drives `tp * pp` Worker services over gRPC streams, `mp` starts
those services as local processes and `ray_group` as Ray actors' processes on a Ray
cluster (placement groups).
"""
