"""Prompts and completions of engines that hold the served model's tokenizer (embedded,
Tinker): the chat template renders each prompt here, and each completion is built from the
sampled ids, so the ids stored with a turn are exactly the ones the model saw and sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agents.engines.base import Completion, Message, SamplingParams, ToolSchema
from agents.toolcalls import assistant_message


def render(
    tokenizer: Any, messages: Sequence[Message], tools: Sequence[ToolSchema] | None, **options: Any
) -> Any:
    """The chat template applied to a conversation, with the generation prompt."""
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=True,
        **options,
    )


def encode(
    tokenizer: Any, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None
) -> list[int]:
    """Prompt token ids of a conversation, ending with the assistant's generation prompt."""
    return list(render(tokenizer, messages, tools, tokenize=True, return_dict=True)["input_ids"])


def id_set(eos: int | list[int] | None) -> set[int]:
    """A model's end-of-sequence id or ids (as its configs write them) as a set."""
    if eos is None:
        return set()
    return set(eos if isinstance(eos, list) else [eos])


def token_completion(
    tokenizer: Any,
    eos_ids: set[int],
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    logprobs: Sequence[float],
    sampling: SamplingParams,
    version: int,
    tools: Sequence[ToolSchema] | None,
) -> Completion:
    """The completion of sampled ids: the end-of-sequence token and the stop string cut from
    the message (OpenAI's semantics: the stop string is not returned), tool calls parsed from
    its text only when the request offered `tools` (`agents.toolcalls.assistant_message`)."""
    completion_ids = list(completion_ids)
    text = tokenizer.decode(completion_ids, skip_special_tokens=False)
    ended_by_eos = bool(completion_ids) and completion_ids[-1] in eos_ids
    body = tokenizer.decode(completion_ids[:-1] if ended_by_eos else completion_ids)
    stops = [body.index(s) for s in sampling.stop if s in body]
    finished = ended_by_eos or bool(stops)
    if stops:
        body = body[: min(stops)]
    message = assistant_message(body, tools)
    reason = "tool_calls" if message.get("tool_calls") else ("stop" if finished else "length")
    return Completion(
        message=message,
        prompt_token_ids=tuple(prompt_ids),
        completion_token_ids=tuple(completion_ids),
        completion_logprobs=tuple(logprobs),
        finish_reason=reason,
        policy_version=version,
        text=text,
        usage={"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids)},
    )
