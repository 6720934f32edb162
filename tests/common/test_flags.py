"""Flags declared once: each config field's metadata gives its flag, and what the parser
reads back, what a child role is handed and what docs/cli.md lists all come from it."""

import subprocess
import sys
from pathlib import Path

from pagestream.cli import build_parser
from pagestream.cli_flags import RankConfig, ServingConfig, reference_markdown, role_argv
from pagestream.engine_args import EngineArgs
from services.common.flags import from_flags, to_flags
from services.frontend.frontend_config import FrontendConfig
from services.frontend.router import RouterConfig
from services.frontend.tool_options import ToolServerOptions

ROOT = Path(__file__).resolve().parents[2]


def _serve(*argv: str):
    return build_parser().parse_args(["serve", "m", *argv])


def test_parsed_flags_become_the_configs_and_defaults_stay_defaults():
    ns = _serve()
    assert from_flags(FrontendConfig, ns) == FrontendConfig()
    assert from_flags(RouterConfig, ns) == RouterConfig()
    assert from_flags(ServingConfig, ns) == ServingConfig()
    # the serving roles bound the waiting queue; the Python API does not
    assert from_flags(EngineArgs, ns).max_waiting_requests == 1024
    assert EngineArgs().max_waiting_requests == 0


def test_every_config_reaches_a_child_role_unchanged():
    configs = [
        EngineArgs(
            dtype="float32",
            max_num_seqs=3,
            enable_prefix_caching=False,
            quantization="int8",
            enforce_eager=True,
        ),
        FrontendConfig(max_n=4, request_timeout_s=2.5),
        RouterConfig(policy="round_robin", cache_threshold=0.25),
        ToolServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"),
        ServingConfig(port=-1, api_key="k"),
    ]
    argv = role_argv("serve", "m", *configs)
    ns = build_parser().parse_args(argv[argv.index("serve") :])
    for config in configs:
        assert from_flags(type(config), ns) == config


def test_enforce_eager_reaches_the_model_config():
    args = from_flags(EngineArgs, _serve("--enforce-eager"))
    assert args.enforce_eager and args.model_config().enforce_eager
    assert not from_flags(EngineArgs, _serve()).model_config().enforce_eager


def test_cpu_threads_bind_reaches_a_worker_ranks_model_config():
    from pagestream.executor_factory import worker_cli_args

    argv = worker_cli_args(EngineArgs(cpu_threads_bind="none"), 0, "file:///r", "f", "h", 0)
    ns = build_parser().parse_args(argv[2:])  # after `-m pagestream.cli`
    assert from_flags(EngineArgs, ns).model_config().cpu_threads_bind == "none"
    assert from_flags(EngineArgs, _serve()).model_config().cpu_threads_bind == "auto"


def test_a_child_of_the_python_api_keeps_its_unbounded_queue():
    assert to_flags(EngineArgs()) == ["--max-waiting-requests", "0"]
    ns = build_parser().parse_args(["scheduler", "m", *to_flags(EngineArgs())])
    assert from_flags(EngineArgs, ns) == EngineArgs(model=EngineArgs().model)


def test_a_worker_rank_round_trips():
    place = RankConfig(rank=1, local_rank=1, dist_init_method="file:///tmp/r", ready_file="f")
    ns = build_parser().parse_args(["worker", "m", *to_flags(place)])
    assert from_flags(RankConfig, ns) == place


def test_docs_cli_md_is_current():
    assert (ROOT / "docs" / "cli.md").read_text(encoding="utf-8") == reference_markdown(), (
        "docs/cli.md is stale: run `make cli-docs`"
    )


def test_building_the_parser_loads_no_torch_transformers_or_fastapi():
    """Every role (the torch-free scheduler over --worker, the frontend child, each mp
    worker before it loads its model) builds the parser first: it must stay light."""
    code = (
        "import sys, pagestream.cli; pagestream.cli.build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_a_plain_text_chat_template_is_refused_before_the_model_loads(caplog, tmp_path):
    """`serve --chat-template WORDS` (neither a file nor a Jinja template) stops at once,
    naming the flag: the model (here a folder that does not exist) is never read."""
    from pagestream.cli import main

    missing = tmp_path / "no-such-model"
    code = main(["serve", str(missing), "--chat-template", "plain words", "--port", "-1"])
    assert code == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors and "--chat-template" in errors[-1] and "neither a file" in errors[-1]
