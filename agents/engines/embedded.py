"""The embedded engine: transformers (+ peft for adapters) in this process, for CPU machines.

One copy of the weights serves the policy (through the LoRA adapter, once one is loaded)
and the self-judge / teacher (`adapter=None`, the adapter switched off). Requests are run
one at a time under a lock.

Log-probs are the model's raw ones (log-softmax of the logits at temperature 1, before
temperature and top-p), as vLLM reports them by default, so that the learner's recomputed
log-probs are comparable with the rollout's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from agents import models
from agents.engines.base import (
    BASE,
    POLICY,
    Completion,
    Message,
    SamplingParams,
    TokenChunk,
    ToolSchema,
)
from agents.toolcalls import parse_tool_calls

logger = logging.getLogger(__name__)


class EmbeddedEngine:
    """transformers + peft in process.

    Args:
        model: a model name or directory, as `agents.models.resolve` takes it.
        threads: torch CPU threads (None leaves torch's default).
    """

    def __init__(self, model: str = "tiny", threads: int | None = None):
        if threads is not None:
            torch.set_num_threads(threads)
        self.model_name = model
        self.model, self.tokenizer = models.load(model)
        self._lock = threading.Lock()
        self._version = 0
        self._peft: Any = None
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        *_, completion = self.stream(messages, tools, sampling, adapter)
        assert isinstance(completion, Completion)
        return completion

    def stream(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Iterator[TokenChunk | Completion]:
        sampling = sampling or SamplingParams()
        prompt_ids = self.encode(messages, tools)
        completion_ids: list[int] = []
        logprobs: list[float] = []
        shown = ""
        # The lock is held while the stream is consumed; closing the generator releases it.
        with self._lock, torch.inference_mode(), self._adapter(adapter) as (model, version):
            generator = None
            if sampling.seed is not None:
                generator = torch.Generator().manual_seed(sampling.seed)
            stopped = self._stop_check(sampling.stop)
            for token, logprob in _sample(model, prompt_ids, sampling, self._eos_ids(), generator):
                completion_ids.append(token)
                logprobs.append(logprob)
                decoded = self.tokenizer.decode(completion_ids)
                # Hold text back while it ends in an incomplete UTF-8 character.
                delta = "" if decoded.endswith("\ufffd") else decoded[len(shown) :]
                shown += delta
                yield TokenChunk((token,), (logprob,), delta)
                if stopped is not None and stopped(completion_ids):
                    break
        yield self._completion(prompt_ids, completion_ids, logprobs, sampling, version)

    def _completion(
        self,
        prompt_ids: list[int],
        completion_ids: list[int],
        logprobs: list[float],
        sampling: SamplingParams,
        version: int,
    ) -> Completion:
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=False)
        ended_by_eos = bool(completion_ids) and completion_ids[-1] in self._eos_ids()
        body = self.tokenizer.decode(completion_ids[:-1] if ended_by_eos else completion_ids)
        stops = [body.index(s) for s in sampling.stop if s in body]
        finished = ended_by_eos or bool(stops)
        if stops:
            body = body[: min(stops)]  # OpenAI's semantics: the stop string is not returned
        message = parse_tool_calls(body)
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

    def encode(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None
    ) -> list[int]:
        """Prompt token ids of a conversation, ending with the assistant's generation prompt."""
        encoded = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])

    def score(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], adapter: str | None = BASE
    ) -> list[float]:
        ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
        with self._lock, torch.inference_mode(), self._adapter(adapter) as (model, _):
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
        return (
            torch.log_softmax(logits.float(), dim=-1)
            .gather(-1, ids[0, len(prompt_ids) :, None])[:, 0]
            .tolist()
        )

    def load_adapter(self, path: str, version: int) -> None:
        from peft import PeftModel

        name = f"v{version}"
        with self._lock:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
            else:
                old = self._peft.active_adapter
                self._peft.load_adapter(path, adapter_name=name)
                self._peft.set_adapter(name)
                self._peft.delete_adapter(old)
            self._peft.eval()
            self._version = version
        logger.info("serving adapter %s as policy version %d", path, version)

    def close(self) -> None:
        self._closed = True

    def _stop_check(self, stops: Sequence[str]) -> Callable[[list[int]], bool] | None:
        if not stops:
            return None
        longest = max(len(s) for s in stops)

        def stopped(ids: list[int]) -> bool:
            # A stop string spans at most `longest` characters, hence at most that many tokens.
            tail = self.tokenizer.decode(ids[-longest:])
            return any(s in tail for s in stops)

        return stopped

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos])

    def _adapter(self, adapter: str | None) -> _AdapterScope:
        if adapter not in (BASE, POLICY):
            raise ValueError(
                f"unknown adapter {adapter!r}; the embedded engine serves {POLICY!r} or None"
            )
        return _AdapterScope(self, use_policy=adapter == POLICY)


class _AdapterScope:
    """The model to run and the version it serves: the policy adapter, or the base model
    (the adapter disabled for the duration; callers hold the engine's lock)."""

    def __init__(self, engine: EmbeddedEngine, use_policy: bool):
        self.engine, self.use_policy = engine, use_policy
        self._disabled: Any = None

    def __enter__(self) -> tuple[Any, int]:
        peft = self.engine._peft
        if peft is None:
            return self.engine.model, 0
        if self.use_policy:
            return peft, self.engine._version
        self._disabled = peft.disable_adapter()
        self._disabled.__enter__()
        return peft, 0

    def __exit__(self, *exc: object) -> None:
        if self._disabled is not None:
            self._disabled.__exit__(*exc)


def _sample(
    model: Any,
    prompt_ids: list[int],
    sampling: SamplingParams,
    eos_ids: set[int],
    generator: torch.Generator | None,
) -> Iterator[tuple[int, float]]:
    """Token-by-token sampling with a KV cache; yields each id with its raw log-prob."""
    ids = torch.tensor([prompt_ids])
    past = None
    for _ in range(sampling.max_tokens):
        out = model(input_ids=ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        raw = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = _pick(raw, sampling, generator)
        yield token, float(raw[token])
        if token in eos_ids:
            return
        ids = torch.tensor([[token]])


def _pick(
    logprobs: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> int:
    if sampling.temperature == 0.0:
        return int(logprobs.argmax())
    probs = torch.softmax(logprobs / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = ordered.cumsum(-1) - ordered >= sampling.top_p
        ordered[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, ordered)
    return int(torch.multinomial(probs, 1, generator=generator))
