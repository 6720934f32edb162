"""The `pagestream` roles' flags and the command lines of their child processes.

Every flag is a field of a config dataclass (services/common/flags.py): the engine's
(EngineArgs), the frontend's protections (FrontendConfig), tool calling
(ToolServerOptions), served LoRA adapters (LoRAServerOptions), the data-parallel router
(RouterConfig), TLS (TlsConfig), and, here, the serving ports (ServingConfig) and a worker
group rank (RankConfig). The parser, the argv handed to a child role (`role_argv`) and
the flag reference in docs/cli.md all come from those fields.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagestream.engine_args import EngineArgs
from pagestream.models.models_config import ModelsConfig
from services.common.flags import flag, flag_table, to_flags
from services.common.tls import TlsConfig
from services.frontend.frontend_config import FrontendConfig
from services.frontend.lora_options import LoRAServerOptions
from services.frontend.router import RouterConfig
from services.frontend.tool_options import ToolServerOptions


@dataclass(frozen=True)
class ServingConfig:
    """Where the public APIs listen."""

    host: str = flag("127.0.0.1", "address to bind (0.0.0.0: all)")
    grpc_port: int = flag(50051, "public gRPC port")
    port: int = flag(8000, "OpenAI HTTP port (-1: off)")
    api_key: str | None = flag(
        None,
        "require this bearer key on HTTP /v1 and on the gRPC Generation API "
        "(default: $PAGESTREAM_API_KEY)",
    )
    allow_unauthenticated: bool = flag(
        False, "serve a --host beyond loopback with no API key (refused at start otherwise)"
    )


@dataclass(frozen=True)
class RankConfig:
    """A rank of a worker group (defaults from RANK / LOCAL_RANK / MASTER_ADDR+PORT)."""

    rank: int | None = flag(None, "this worker's rank (default: $RANK or 0)")
    local_rank: int | None = flag(None, "CUDA device index ($LOCAL_RANK)")
    dist_init_method: str | None = flag(
        None,
        "where the group's ranks meet: tcp://HOST:PORT or file:///PATH "
        "(default: tcp://$MASTER_ADDR:$MASTER_PORT)",
    )
    dist_timeout: float = flag(120.0, "seconds to wait for the other ranks")
    ready_file: str | None = flag(None, "write the bound address here once listening")
    cpu_cores: str | None = flag(
        None,
        "the CPUs this rank runs on, e.g. 0-3 (the mp launcher gives each local rank a "
        "share of its own; default: the process's affinity mask)",
    )


# The frontend role's flags (serve's too): its ports, protections, tool calling, routing.
FRONTEND_CONFIGS = (
    ServingConfig,
    FrontendConfig,
    ToolServerOptions,
    LoRAServerOptions,
    RouterConfig,
)
# The engine arguments a frontend itself uses (the name it serves, the sampling defaults).
FRONTEND_ENGINE_FLAGS = ("served_model_name", "generation_config")


def log_level_name() -> str:
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return level if isinstance(level, str) else "INFO"


def role_argv(role: str, model: str, *configs, log_level: str | None = None) -> list[str]:
    """The interpreter arguments that start `pagestream ROLE MODEL` with these configs'
    flags (each config as its non-default flags; a list of strings as it is)."""
    argv = ["-m", "pagestream.cli", "--log-level", log_level or log_level_name(), role, model]
    for config in configs:
        argv += config if isinstance(config, list) else to_flags(config)
    return argv


def reference_markdown() -> str:
    """docs/cli.md: every flag of every config, with the roles that take it."""
    sections = [
        (
            EngineArgs,
            "generate, serve, worker, scheduler (frontend: --served-model-name and "
            "--generation-config); the default is the serving roles' (`generate` queues every "
            "prompt: --max-waiting-requests 0)",
        ),
        *((config, "serve, frontend") for config in FRONTEND_CONFIGS),
        (TlsConfig, "serve, worker, scheduler, frontend"),
        (RankConfig, "worker"),
        (ModelsConfig, "serve (many models: pagestream/models/)"),
    ]
    lines = [
        "# pagestream command-line flags",
        "",
        "Generated from the config dataclasses' field metadata (`make cli-docs`; a test checks",
        "that this file is current). `pagestream ROLE --help` prints the same per role, and",
        "also the flags that belong to one role alone and are no config's: `serve`'s",
        "`--single-process`, `--split-services`, `--max-restarts` and `--data-parallel-size`,",
        "`scheduler --worker`, `frontend --scheduler`, the worker's and the scheduler's own",
        "`--host` / `--port`, and `generate`'s prompts and sampling flags.",
    ]
    for config, roles in sections:
        lines += ["", f"## {config.__name__}", "", f"Roles: {roles}.", ""]
        lines += ["| flag | default | meaning |", "|---|---|---|"]
        for name, default, help_text in flag_table(config):
            cell = f"`{default}`" if default else ""
            lines.append(f"| `{name}` | {cell} | {help_text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(reference_markdown())
