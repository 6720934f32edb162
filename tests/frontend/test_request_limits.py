"""RequestLimits and FrontendConfig: each refusal names the field, the limit and its flag;
bad settings fail at start naming the setting."""

import pytest

from services.common.flags import from_flags
from services.frontend.api_key import ApiKey, AuthenticationError
from services.frontend.frontend_config import FrontendConfig
from services.frontend.request_limits import LimitExceededError, RequestLimits

LIMITS = RequestLimits(FrontendConfig(max_prompt_bytes=10, max_messages=2, max_n=3), 16)


@pytest.mark.parametrize(
    ("check", "param", "flag"),
    [
        (lambda: LIMITS.check_prompt_text("x" * 11), "prompt", "--max-prompt-bytes"),
        (lambda: LIMITS.check_prompt_text("é" * 6, "text"), "text", "--max-prompt-bytes"),
        (lambda: LIMITS.check_messages(["a", "b", "c"]), "messages", "--max-messages"),
        (lambda: LIMITS.check_messages(["a" * 6, "b" * 6]), "messages", "--max-prompt-bytes"),
        (lambda: LIMITS.check_n(4), "n", "--max-n"),
        (lambda: LIMITS.check_max_tokens(16), "max_tokens", "max_model_len"),
        (lambda: LIMITS.check_token_ids(list(range(17))), "prompt", "max_model_len"),
    ],
)
def test_each_refusal_names_the_field_and_the_limit(check, param, flag):
    with pytest.raises(LimitExceededError) as refused:
        check()
    assert refused.value.param == param
    assert str(refused.value).startswith(param) and flag in str(refused.value)
    assert isinstance(refused.value, ValueError)  # HTTP 400, gRPC INVALID_ARGUMENT


def test_what_fits_passes():
    LIMITS.check_prompt_text("x" * 10)
    LIMITS.check_messages(["a" * 5, "b" * 5])
    LIMITS.check_n(3)
    LIMITS.check_max_tokens(15)
    LIMITS.check_max_tokens(None)
    LIMITS.check_token_ids(list(range(16)))


def test_defaults_follow_the_context_and_zero_means_no_limit():
    default = RequestLimits(FrontendConfig(), 256)
    assert default.max_prompt_bytes == 32 * 256
    off = RequestLimits(FrontendConfig(max_prompt_bytes=0, max_messages=0), 256)
    off.check_prompt_text("x" * 1_000_000)
    off.check_messages(["m"] * 100_000)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_prompt_bytes", -1),
        ("max_messages", -1),
        ("max_n", 0),
        ("max_request_body_bytes", -5),
        ("max_unread_tokens", -1),
        ("request_timeout_s", 0),
    ],
)
def test_bad_settings_name_the_setting(field, value):
    with pytest.raises(ValueError, match=field):
        FrontendConfig(**{field: value})


def test_config_from_parsed_flags():
    class Flags:
        max_n = 4
        request_timeout_s = 2.5
        unrelated = "ignored"

    config = from_flags(FrontendConfig, Flags())
    assert (config.max_n, config.request_timeout_s, config.max_messages) == (4, 2.5, 1024)


def test_api_key_compares_whole_header_values():
    key = ApiKey("secret")
    assert key.required and key.allows("Bearer secret") and key.allows(b"Bearer secret")
    for wrong in (None, "", "secret", "Bearer secre", "Bearer secret2", "bearer secret"):
        assert not key.allows(wrong)
        with pytest.raises(AuthenticationError):
            key.check(wrong)
    assert ApiKey(None).allows(None) and not ApiKey("").required
