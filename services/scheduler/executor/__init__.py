"""Executors: how the engine core runs a step plan on its worker(s).

`Executor` (executor.py) is the protocol the engine core uses; `uni` runs one in-process
worker, `worker_group` drives `tp * pp` Worker services over gRPC streams. Starting those
services is a launcher's job (services/scheduler/launchers: mp, ray).
"""
