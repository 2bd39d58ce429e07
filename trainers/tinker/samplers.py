"""Who samples for the Tinker server's sampling clients: the base model, or a saved
checkpoint's LoRA adapter on it, token ids in, token ids and log-probs out.

`TorchSampler` generates in the server's own process (transformers, a KV cache, one
sequence at a time); `VLLMSampler` asks a vLLM server (`engine=vllm`), each checkpoint
loaded into it as a named LoRA adapter, so the samples come out of vLLM's batched decoding.
Both report a token's log-prob as the model's own (vLLM's `raw_logprobs`: temperature 1,
before top-k / top-p), the numbers `compute_logprobs` and forward_backward's `logprobs` give.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import uuid
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import torch

from agents import models
from agents.config import EngineConfig, ModelConfig
from agents.engines.openai_http import OpenAIHTTP, ServerError
from trainers.tinker.errors import UserError
from trainers.tinker.sampling import SamplingParams, generate, target_logprobs
from trainers.tinker.wire import Sampled

if TYPE_CHECKING:
    from agents.engines.vllm import VLLMEngine

logger = logging.getLogger(__name__)


class Sampler(Protocol):
    """What the Tinker server samples with."""

    def sample(
        self,
        adapter: Path | None,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        prompt_logprobs: bool,
    ) -> tuple[list[Sampled], list[float] | None]:
        """`num_samples` continuations of `prompt` under the adapter in directory `adapter`
        (None: the base model), and the prompt's own log-probs (NaN first) when asked."""
        ...

    def forget(self, adapter: Path) -> None:
        """The adapter in `adapter` was overwritten: sample the new one from now on."""
        ...

    def close(self) -> None: ...


class TorchSampler:
    """Generates in this process: each adapter is loaded onto its own copy of the base
    model, and the `max_copies` most recently used copies are kept (an RL loop that samples
    a new checkpoint each step holds a bounded number of them)."""

    def __init__(self, model_name: str, max_copies: int = 4):
        self.model_name, self.max_copies = model_name, max_copies
        self._models: OrderedDict[str, Any] = OrderedDict()
        self._tokenizer: Any = None

    def sample(
        self,
        adapter: Path | None,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        prompt_logprobs: bool,
    ) -> tuple[list[Sampled], list[float] | None]:
        model = self._model(adapter)
        # unseeded calls draw fresh randomness, as Tinker's do: a GRPO group of samples of
        # one prompt must differ
        generator = torch.Generator()
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        with torch.no_grad():
            scored = None
            if prompt_logprobs:
                lp = target_logprobs(model, torch.tensor(prompt[:-1]), torch.tensor(prompt[1:]))
                scored = [math.nan, *lp.tolist()]
            sequences = [
                generate(model, prompt, params, generator, partial(self._stopped, params))
                for _ in range(num_samples)
            ]
        return sequences, scored

    def forget(self, adapter: Path) -> None:
        self._models.pop(str(adapter), None)

    def close(self) -> None:
        self._models.clear()

    def _stopped(self, params: SamplingParams, tokens: list[int]) -> bool:
        if not params.stop_strings:
            return False
        if self._tokenizer is None:
            self._tokenizer = models.load_tokenizer(self.model_name)
        text = self._tokenizer.decode(tokens)
        return any(text.endswith(stop) for stop in params.stop_strings)

    def _model(self, adapter: Path | None) -> Any:
        key = str(adapter or "")
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        while len(self._models) >= self.max_copies:
            self._models.popitem(last=False)
        base, _ = models.load(self.model_name)
        if adapter is not None:
            from peft import PeftModel

            base = PeftModel.from_pretrained(base, adapter)
        self._models[key] = base.to(dtype=torch.float32).eval()
        return self._models[key]


class VLLMSampler:
    """Samples through a vLLM server's `/v1/completions` on token-id prompts. A checkpoint
    is loaded as LoRA `tinker-<sampler>-<n>` the first time it is sampled (vLLM keeps
    `--max-loras` of them on the device and reloads others from their directories as
    needed); an overwritten or deleted one is unloaded. A rank above the server's
    `max_lora_rank` is the client's error, said before vLLM is asked.

    Sampling follows Tinker's rules, not vLLM's defaults: only the stop tokens and strings
    asked for end a sequence (the end-of-sequence token is an ordinary token unless named),
    every sampled token id is returned (a stop string's tokens included), and special tokens
    are kept in the text a stop string is matched against.
    """

    def __init__(self, engine: VLLMEngine, max_lora_rank: int, request_timeout: float = 600.0):
        self.engine, self.max_lora_rank = engine, max_lora_rank
        self._http = OpenAIHTTP(engine.base_url, timeout=request_timeout)
        self._names: dict[Path, str] = {}
        self._loads = itertools.count(1)
        # names unique to this sampler: a vLLM server may outlive it and serve others
        self._prefix = uuid.uuid4().hex[:8]

    def sample(
        self,
        adapter: Path | None,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        prompt_logprobs: bool,
    ) -> tuple[list[Sampled], list[float] | None]:
        body = completion_body(self._served(adapter), prompt, num_samples, params, prompt_logprobs)
        response = self._post("completions", body)
        return parse_completion(response, prompt, num_samples, prompt_logprobs)

    def forget(self, adapter: Path) -> None:
        name = self._names.pop(adapter, None)
        if name is not None:
            self._post("unload_lora_adapter", {"lora_name": name})

    def release(self) -> None:
        """Unloads every adapter this sampler loaded (a vLLM server that outlives it is left
        serving what it served before)."""
        for adapter in list(self._names):
            self.forget(adapter)

    def close(self) -> None:
        self.release()
        self._http.close()
        self.engine.close()

    def _served(self, adapter: Path | None) -> str:
        """The served model name of the base model or of the adapter, loaded if new."""
        if adapter is None:
            return self.engine.base_name
        if adapter not in self._names:
            rank = int(json.loads((adapter / "adapter_config.json").read_text())["r"])
            if rank > self.max_lora_rank:
                raise UserError(
                    f"the checkpoint's LoRA rank {rank} is above the vLLM server's "
                    f"max_lora_rank {self.max_lora_rank}: serve with engine.max_lora_rank={rank} "
                    "(a vLLM size: 8, 16, 32, 64...) or train a lower rank"
                )
            name = f"tinker-{self._prefix}-{next(self._loads)}"
            body = {"lora_name": name, "lora_path": str(adapter.resolve())}
            self._post("load_lora_adapter", body)
            self._names[adapter] = name
        return self._names[adapter]

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """A request to vLLM: its refusal of the request is the client's error; a server
        that died says so with its log."""
        try:
            return self._http.post(path, body)
        except ServerError as error:
            if 400 <= error.status < 500:
                raise UserError(f"vLLM refused the request: {error.message}") from error
            raise self._died(error) from error
        except httpx.TransportError as error:
            raise self._died(error) from error

    def _died(self, error: Exception) -> Exception:
        death = self.engine.server.death(wait=5.0)
        return death if death is not None else error


def completion_body(
    model: str, prompt: list[int], num_samples: int, params: SamplingParams, prompt_logprobs: bool
) -> dict[str, Any]:
    """A vLLM `/v1/completions` body that samples as Tinker does."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "n": num_samples,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop_tokens:
        body["stop_token_ids"] = list(params.stop_tokens)
    if params.stop_strings:
        body["stop"] = list(params.stop_strings)
    if prompt_logprobs:
        body["prompt_logprobs"] = 0
    return body


def parse_completion(
    response: dict[str, Any], prompt: list[int], num_samples: int, prompt_logprobs: bool
) -> tuple[list[Sampled], list[float] | None]:
    """The sequences (in vLLM's choice order) and the prompt's log-probs of a
    `completion_body` response."""
    choices = sorted(response.get("choices") or [], key=lambda c: int(c.get("index", 0)))
    if len(choices) != num_samples:
        raise RuntimeError(f"vLLM returned {len(choices)} choices for {num_samples} samples")
    sequences = []
    for choice in choices:
        logprobs = choice.get("logprobs") or {}
        tokens = tuple(_token_id(t) for t in logprobs.get("tokens") or ())
        values = tuple(float(v) for v in logprobs.get("token_logprobs") or ())
        if len(tokens) != len(values):
            raise RuntimeError("vLLM returned a different number of tokens and log-probs")
        sequences.append(Sampled(tokens, values, choice.get("finish_reason") == "stop"))
    scored = None
    if prompt_logprobs:
        entries = choices[0].get("prompt_logprobs") or response.get("prompt_logprobs")
        if not entries or len(entries) != len(prompt):
            raise RuntimeError("vLLM returned no prompt log-probs for the whole prompt")
        scored = [math.nan] + [
            _logprob_of(entries[i], token) for i, token in enumerate(prompt) if i > 0
        ]
    return sequences, scored


def _token_id(token: str) -> int:
    """vLLM's `token_id:<n>` (return_tokens_as_token_ids) as the id."""
    if not token.startswith("token_id:"):
        raise RuntimeError(f"vLLM returned token {token!r}, not a token id")
    return int(token.removeprefix("token_id:"))


def _logprob_of(entry: dict[str, Any] | None, token: int) -> float:
    found = (entry or {}).get(str(token))
    if found is None:
        raise RuntimeError(f"vLLM returned no prompt log-prob for token {token}")
    return float(found["logprob"] if isinstance(found, dict) else found)


def build_sampler(engine: EngineConfig, model: ModelConfig, shares_gpu: bool = False) -> Sampler:
    """The sampler `engine.backend` names. vLLM on a CPU computes on half the cores (the
    last ones, `engine.threads` of them if set) and the learner's torch threads on the
    others, as in a training run: two sets of OpenMP threads on the same cores slow both;
    on a GPU the learners train on (`shares_gpu`) it takes half the GPU's memory unless
    `engine.gpu_memory_utilization` says otherwise.

    Raises:
        ValueError: engine=remote (an OpenAI endpoint samples no token-id prompts under
            checkpoints this server saves).
    """
    if engine.backend == "embedded":
        return TorchSampler(model.name)
    if engine.backend != "vllm":
        raise ValueError(
            f"engine={engine.backend} cannot sample for the Tinker server: use embedded or vllm"
        )
    from agents.compose import build_engine, cuda_available, place_beside_learner

    learner_cpus, cpus = place_beside_learner(engine, learner_on_cpu=not cuda_available())
    if learner_cpus is not None:
        torch.set_num_threads(len(learner_cpus))
        logger.info("cores: learner %s, vLLM %s", learner_cpus, cpus)
    vllm = build_engine(engine, model, shares_gpu_with_learner=shares_gpu, cpus=cpus)
    return VLLMSampler(vllm, engine.max_lora_rank)  # type: ignore[arg-type]
