"""The flag groups of the `pagestream` roles: serving ports, the frontend's protections,
tool calling, the data-parallel router, TLS, and a worker group's rank and rendezvous."""

from __future__ import annotations

import argparse


def add_serving_args(parser: argparse.ArgumentParser, grpc_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: all)")
    parser.add_argument("--grpc-port", type=int, default=grpc_port, help="public gRPC port")
    parser.add_argument("--port", type=int, default=8000, help="OpenAI HTTP port (-1: off)")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require this bearer key on HTTP /v1 and on the gRPC Generation API "
        "(default: $PAGESTREAM_API_KEY)",
    )


def add_frontend_limit_args(parser: argparse.ArgumentParser) -> None:
    """The frontend's protections (services/frontend/frontend_config.py)."""
    add = parser.add_argument
    add(
        "--max-prompt-bytes",
        type=int,
        default=None,
        help="refuse (400) text prompts, or chat messages together, over this many UTF-8 "
        "bytes, before tokenizing (default: 32 x the context length; 0: no limit)",
    )
    add("--max-messages", type=int, default=1024, help="chat messages per request (0: any)")
    add("--max-n", type=int, default=128, help="sequences (n, beam width) per prompt")
    add(
        "--max-request-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="refuse (400) HTTP request bodies over this size (0: no limit)",
    )
    add(
        "--request-timeout",
        dest="request_timeout_s",
        type=float,
        default=None,
        help="abort requests that run longer than this many seconds (gRPC DEADLINE_EXCEEDED, "
        "HTTP 504); default: no limit",
    )
    add(
        "--max-unread-tokens",
        type=int,
        default=4096,
        help="abort a stream whose client leaves more than this many tokens unread "
        "(a client that stopped reading; 0: no bound)",
    )


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """Tool calling and the chat template (services/frontend/openai/tool_choice.py)."""
    from services.frontend.tool_parsers import TOOL_PARSERS

    add = parser.add_argument
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto": the model decides, its output is parsed for calls '
        "(needs --tool-call-parser)",
    )
    add(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help='the model\'s tool-call format: parses "auto" replies and shapes the grammar of '
        '"required" / named-function requests (default for those: hermes)',
    )
    add(
        "--chat-template",
        default=None,
        help="a chat template file, or the template itself, instead of the model's",
    )


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """How the frontend picks a data-parallel replica (services/frontend/router.py)."""
    from services.frontend.router import ROUTER_POLICIES, RouterConfig

    defaults = RouterConfig()
    add = parser.add_argument
    add(
        "--router-policy",
        default=defaults.policy,
        choices=ROUTER_POLICIES,
        help="with several schedulers: cache_aware (the replica holding the longest cached "
        "prefix unless the load is out of balance), least_loaded, or round_robin",
    )
    add(
        "--router-cache-threshold",
        type=float,
        default=defaults.cache_threshold,
        help="cache_aware: the cached fraction of a prompt's blocks that sends it to the "
        "replica holding them (below it: the least loaded replica)",
    )
    add(
        "--router-balance-abs-threshold",
        type=int,
        default=defaults.balance_abs_threshold,
        help="cache_aware: route by load alone while the busiest replica has more than this "
        "many requests over the idlest ...",
    )
    add(
        "--router-balance-rel-threshold",
        type=float,
        default=defaults.balance_rel_threshold,
        help="... and more than this many times the idlest's load",
    )


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--tls-cert", default=None, help="PEM certificate: this role's gRPC server speaks TLS")
    add("--tls-key", default=None, help="PEM private key of --tls-cert")
    add(
        "--tls-ca",
        default=None,
        help="PEM CA: verify the services this role connects to, and require client "
        "certificates signed by it on the internal Worker and EngineCore services (mTLS)",
    )


def add_worker_group_args(parser: argparse.ArgumentParser) -> None:
    """A rank of a worker group (defaults from RANK / LOCAL_RANK / MASTER_ADDR+PORT)."""
    add = parser.add_argument
    add("--rank", type=int, default=None, help="this worker's rank (default: $RANK or 0)")
    add("--local-rank", type=int, default=None, help="CUDA device index ($LOCAL_RANK)")
    add(
        "--dist-init-method",
        default=None,
        help="where the group's ranks meet: tcp://HOST:PORT or file:///PATH "
        "(default: tcp://$MASTER_ADDR:$MASTER_PORT)",
    )
    add("--dist-timeout", type=float, default=120.0, help="seconds to wait for the other ranks")
    add("--ready-file", default=None, help="write the bound address here once listening")
