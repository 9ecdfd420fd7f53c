"""The chat path's errors name the caller's fields (`caller_field`), for the APIs translated
into a chat completion (Responses, Messages, Ollama)."""

from __future__ import annotations

import pytest

from server.http.common.chat_translation import caller_field, renamed_params
from server.http.common.errors import APIError

ANTHROPIC = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def test_a_message_names_the_callers_field_and_keeps_its_other_words():
    """Only the field is renamed: "stop" elsewhere in the message stays (a text replace of the
    field's name would write "stop_sequences strings")."""
    with pytest.raises(APIError) as e, renamed_params(ANTHROPIC):
        field = caller_field("stop")
        raise APIError(400, f"{field}: stop strings may not be empty", param=field)
    assert e.value.message == "stop_sequences: stop strings may not be empty"
    assert e.value.param == "stop_sequences"


def test_a_param_named_the_chat_way_is_renamed_and_its_message_left_as_written():
    with pytest.raises(APIError) as e, renamed_params(ANTHROPIC):
        raise APIError(400, "at most 4 stop sequences", param="stop")
    assert (e.value.message, e.value.param) == ("at most 4 stop sequences", "stop_sequences")


def test_outside_a_translation_the_chat_names_stand():
    assert caller_field("stop") == "stop"
    with renamed_params(ANTHROPIC):
        assert caller_field("max_completion_tokens") == "max_tokens"
    assert caller_field("max_completion_tokens") == "max_completion_tokens"
