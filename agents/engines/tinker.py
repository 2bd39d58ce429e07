"""An engine over the Tinker SDK: a Tinker service samples and scores, clawgym renders.

The chat template is applied here, with the served model's own tokenizer, so the prompt ids
stored with each turn are the ones the service sampled from; the service returns the
sampled ids with their log-probs (the model's raw ones, as vLLM's), and `score` asks it for
`compute_logprobs` on the base model (the adapter off: the self-judge's teacher) or on the
policy. Publishing a version (`load_adapter`) switches the policy to a sampling client on
the checkpoint the Tinker learner saved for it (`trainers.tinker_learner`): the adapter
directory it writes holds the checkpoint's `tinker://` path (`TINKER_POINTER`).

Tokens come back when the service has sampled the whole reply: `stream` yields them as one
chunk before the completion (`agents.engines.aio.WholeReplies`); the service's calls block,
and `agenerate` and `astream` run them on the engine's threads.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.engines import template
from agents.engines.aio import WholeReplies
from agents.engines.base import (
    BASE,
    POLICY,
    Completion,
    Message,
    SamplingParams,
    ToolSchema,
    check_adapter,
    completion_room,
    refuse_images,
)

logger = logging.getLogger(__name__)

TINKER_POINTER = "tinker.json"
"""The file of an adapter directory that names its Tinker checkpoint: {"model_path": ...}."""


class TinkerEngine(WholeReplies):
    """Samples and scores through a Tinker service.

    Args:
        service: a `tinker.ServiceClient`.
        base_model: the service's name of the base model.
        tokenizer: the base model's tokenizer (its chat template renders the prompts).
        context_length: the longest prompt plus completion the service takes.
        owns_service: `close` finishes the service client's session (its heartbeats stop):
            for the engine of a run, closed last.
    """

    CLOSE_TIMEOUT_S = 30.0
    """How long `close` waits for the service to finish the session (it may be gone)."""

    def __init__(
        self,
        service: Any,
        base_model: str,
        tokenizer: Any,
        context_length: int,
        owns_service: bool = False,
    ):
        self.service, self.tokenizer, self.context_length = service, tokenizer, context_length
        self._owns_service = owns_service
        self._base = service.create_sampling_client(base_model=base_model).result()
        self._policy: tuple[Any, int] = (self._base, 0)
        """The policy's sampling client and its version, swapped as one."""
        self._lock = threading.Lock()
        self._eos = template.id_set(tokenizer.eos_token_id)

    @property
    def policy_version(self) -> int:
        return self._policy[1]

    def generate(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSchema] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = POLICY,
    ) -> Completion:
        from tinker import types

        sampling = sampling or SamplingParams()
        client, version = self._client(adapter)
        prompt_ids = self.encode(messages, tools)
        room = completion_room(len(prompt_ids), self.context_length)
        params = types.SamplingParams(
            max_tokens=min(sampling.max_tokens, room),
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            # Tinker stops on EOS only when told (clawgym's server) or by default: tell it
            stop=list(sampling.stop) if sampling.stop else sorted(self._eos),
        )
        reply = client.sample(types.ModelInput.from_ints(prompt_ids), 1, params).result()
        sequence = reply.sequences[0]
        ids, logprobs = list(sequence.tokens), [float(x) for x in sequence.logprobs or ()]
        if len(logprobs) != len(ids):
            raise RuntimeError("the Tinker service returned no log-prob for some sampled tokens")
        # a service that did not stop at EOS: what follows it is no part of the reply
        end = next((i + 1 for i, token in enumerate(ids) if token in self._eos), len(ids))
        return template.token_completion(
            self.tokenizer,
            self._eos,
            prompt_ids,
            ids[:end],
            logprobs[:end],
            sampling,
            version,
            tools,
        )

    def encode(
        self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None
    ) -> list[int]:
        """Prompt token ids of a conversation, ending with the assistant's generation prompt."""
        return template.encode(self.tokenizer, messages, tools)

    def score(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        adapter: str | None = BASE,
        images: Sequence[bytes] = (),
    ) -> list[float]:
        from tinker import types

        refuse_images(images, "Tinker engine")
        client, _ = self._client(adapter)
        ids = [*prompt_ids, *completion_ids]
        scored = client.compute_logprobs(types.ModelInput.from_ints(ids)).result()
        return [float(x) for x in scored[len(prompt_ids) :]]

    def load_adapter(self, path: str, version: int) -> None:
        """Serves the Tinker checkpoint that the adapter directory `path` names: requests
        already sampling keep their client, later ones get this one."""
        model_path = json.loads((Path(path) / TINKER_POINTER).read_text())["model_path"]
        client = self.service.create_sampling_client(model_path=model_path).result()
        with self._lock:
            self._policy = (client, version)
        logger.info("serving %s as policy version %d", model_path, version)

    def prepare_adapter(self, path: str) -> None:
        """Nothing to prepare: each checkpoint is a sampling client of its own."""

    def close(self) -> None:
        """Finishes the service client's session if this engine owns it (idempotent; a
        service that does not answer is logged, not raised: the run's work is saved)."""
        self._close_threads()
        if not self._owns_service:
            return
        self._owns_service = False
        try:
            self.service.close("success").result(timeout=self.CLOSE_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - any failure of a service going away
            logger.warning("the Tinker session did not finish cleanly: %s", error)

    def _client(self, adapter: str | None) -> tuple[Any, int]:
        check_adapter(adapter, "Tinker engine")
        return self._policy if adapter == POLICY else (self._base, 0)
