"""Test-only: SGLang 0.5.23's own chat sampling defaults, read in-process (what
``hsdump_patch.client.regenerate.SERVER_DEFAULTS`` must equal)."""

from __future__ import annotations

from typing import Any


def sglang_chat_defaults() -> dict[str, Any]:
    """The sampling SGLang's served chat API applies when neither the request nor the model's
    generation config sets a key: ``ChatCompletionRequest.to_sampling_params`` (what
    ``serving_chat.py`` calls) of a request that sets nothing, with no generation-config
    values, for each key that falls back to SGLang's default."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    # max_completion_tokens set: SGLang reads the deprecated max_tokens (a warning) otherwise
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}],
                                    max_completion_tokens=1)
    params = request.to_sampling_params(stop=[], model_generation_config={})
    return {key: params[key] for key in request._DEFAULT_SAMPLING_PARAMS}
