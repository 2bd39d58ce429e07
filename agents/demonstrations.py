"""Demonstrations: episodes played by an environment's scripted reference agent, stored
token-exactly as if the policy had written every reply, for supervised fine-tuning
(`method=sft`), or turns imported from any parquet export of a store.

A demonstration is recorded by the same agent loop as a rollout (`agents.rollout.run_episode`
with a `DirectSeat`), so its sessions look like the policy's own: the same prompts (the
served chat template, the tools in the system turn), next states, per-turn rewards, end
reasons, and context elision when a history outgrows the policy's context. Only the
sampler differs: `ScriptedPolicy` asks the reference agent for each reply and renders it
as the tokens the policy would have to emit for it, through the tokenizer's own chat
template (tool calls in the policy's own format), ending with the end-of-turn token. The
stored message is what those tokens parse back to, so a policy trained on them produces
exactly the actions the agent took.

    with Store(path) as store:
        record_demonstrations(make_env, "terminal", store, tokenizer, episodes=32)
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import gymnasium as gym

from agents.engines.base import BASE, Completion, ContextExceeded, SamplingParams
from agents.rollout import MAX_TURNS, TERMINATED, EpisodeSummary, run_episode
from agents.seats import DirectSeat
from agents.store import Store
from agents.toolcalls import assistant_message
from agents.trajectory import Judgement, Session, SessionStatus, Turn, TurnType
from agents.vision import images_of
from envs.core import Action, AgentEnv, ScriptedAgent, solved

logger = logging.getLogger(__name__)

DEMONSTRATION = "demonstration"
"""The session metadata key that marks a demonstration; its value says where it came from
(the reference agent's class, or `parquet:PATH`)."""


class Score(Protocol):
    """Log-prob of each completion token after the prompt, under some policy; a
    vision-language prompt's decoded images after them (its placeholders expanded)."""

    def __call__(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], images: Sequence[bytes]
    ) -> Sequence[float]: ...


Expand = Callable[[list[int], Sequence[bytes]], list[int]]
"""A vision-language model's prompt ids with each image's placeholder repeated for its
tokens (`agents.vision.expand`), as the engine feeds them."""


class NoReferenceAgent(ValueError):
    """The environment has no scripted solver for a task: it cannot demonstrate it."""


class AgentFailed(ValueError):
    """The reference agent raised choosing its action (a page it does not read as it
    expects, an action it cannot take): its demonstration ends failed with the reason, the
    way a refused request ends a rollout, and the others go on."""


def completion_token_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    reply: Mapping[str, Any],
) -> list[int]:
    """The token ids the policy emits for `reply` after the prompt `messages`: what the
    tokenizer's chat template renders after the generation prompt, up to and including the
    end-of-turn token (the engines stop on it, and keep it in the completion).

    Raises:
        ValueError: the template does not render the conversation as the prompt followed
            by the reply, or never ends the reply's turn.
    """
    options = {"tools": [dict(t) for t in tools] if tools else None, "tokenize": False}
    history = [dict(m) for m in messages]
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True, **options)
    whole = tokenizer.apply_chat_template([*history, dict(reply)], **options)
    if not whole.startswith(prompt):
        raise ValueError("the chat template renders the reply's prompt differently with the reply")
    end_token = tokenizer.convert_ids_to_tokens(_end_of_turn_id(tokenizer))
    rest = whole[len(prompt) :]
    end = rest.find(end_token)
    if end < 0:
        raise ValueError(f"the chat template never ends an assistant turn with {end_token!r}")
    return list(tokenizer(rest[: end + len(end_token)], add_special_tokens=False)["input_ids"])


def _end_of_turn_id(tokenizer: Any) -> int:
    """The token the policy ends its turn with (the generation config's eos for the
    engines; the tokenizer's eos is the same token for ChatML models)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer names no end-of-sequence token")
    return int(eos)


class ReferencePlay(gym.Wrapper[Any, Any, Any, Any]):
    """The env with its reference agent alongside: after each reset the agent of that
    task, and what the agent reads (the latest observation, the info so far, as
    `envs.core.run_episode` gives them)."""

    def __init__(self, env: gym.Env[Any, Any]):
        super().__init__(env)
        self.agent: ScriptedAgent | None = None
        self.observation: list[Mapping[str, Any]] = []
        self.info: dict[str, Any] = {}
        self.agentless = 0
        """Resets whose task had no reference agent."""

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        observation, info = self.env.reset(**kwargs)
        reference = getattr(self.env.unwrapped, "reference_agent", None)
        agent = reference() if reference is not None else None
        if agent is None:
            self.agentless += 1
            raise NoReferenceAgent(
                f"{type(self.env.unwrapped).__name__} has no reference agent for task "
                f"{info.get('task_id')!r}"
            )
        self.agent, self.observation, self.info = agent, list(observation), dict(info)
        return observation, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = self.env.step(action)
        self.observation, self.info = list(observation), self.info | info
        return observation, float(reward), terminated, truncated, info

    def act(self) -> Action:
        """The reference agent's next action."""
        assert self.agent is not None, "reset first"
        return self.agent.act([dict(m) for m in self.observation], self.info)


class ScriptedPolicy:
    """Samples nothing: each reply is the reference agent's action, rendered as the
    policy's tokens (`completion_token_ids`). The generate half of an engine, for
    `DirectSeat`.

    Args:
        play: the env being played, with its reference agent.
        tokenizer: the policy's tokenizer, carrying the served chat template.
        score: the log-probs a turn stores for its tokens (the policy's own, at
            `version`); a demonstration has no sampling log-probs of its own.
        version: the policy version the log-probs are from.
        context_length: a prompt that leaves no room for the reply is refused as past the
            context (`ContextExceeded`), so the episode elides old output as a rollout does.
        expand: a vision-language policy's placeholder expansion (`Expand`), for prompts
            with images (a GUI episode on screenshots); None refuses images.
    """

    def __init__(
        self,
        play: ReferencePlay,
        tokenizer: Any,
        score: Score,
        version: int = 0,
        context_length: int | None = None,
        expand: Expand | None = None,
    ):
        self.play, self.tokenizer, self.score = play, tokenizer, score
        self.version, self.context_length, self.expand = version, context_length, expand

    def generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        adapter: str | None = BASE,
    ) -> Completion:
        try:
            action = self.play.act()
        except Exception as failure:
            raise AgentFailed(
                f"the reference agent could not act: {type(failure).__name__}: {failure}"
            ) from failure
        reply = {"role": "assistant", "content": action} if isinstance(action, str) else action
        prompt_ids = list(
            self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        images = images_of(messages, None)
        if images:
            if self.expand is None:
                raise ValueError("a prompt with images, demonstrated for a text policy")
            prompt_ids = self.expand(prompt_ids, images)
        completion_ids = completion_token_ids(self.tokenizer, messages, tools, reply)
        if self.context_length and len(prompt_ids) + len(completion_ids) > self.context_length:
            raise ContextExceeded(
                f"a demonstration's prompt of {len(prompt_ids)} tokens and reply of "
                f"{len(completion_ids)} are past the context of {self.context_length}"
            )
        # what the policy's tokens parse back to: the action as the env receives it
        message = assistant_message(self.tokenizer.decode(completion_ids[:-1]), tools)
        return Completion(
            message=message,
            prompt_token_ids=tuple(prompt_ids),
            completion_token_ids=tuple(completion_ids),
            completion_logprobs=tuple(
                float(x) for x in self.score(prompt_ids, completion_ids, images)
            ),
            finish_reason="tool_calls" if message.get("tool_calls") else "stop",
            policy_version=self.version,
            text=self.tokenizer.decode(completion_ids, skip_special_tokens=False),
        )


class DemonstrationSeat(DirectSeat):
    """`DirectSeat` that marks its sessions as demonstrations by their reference agent."""

    def __init__(self, policy: ScriptedPolicy, store: Store):
        super().__init__(policy, store)
        self.policy = policy

    def open(self, session: Session) -> None:
        source = type(self.policy.play.agent).__name__
        super().open(session.replace(metadata={**session.metadata, DEMONSTRATION: source}))


def record_demonstrations(
    make_env: Callable[[], gym.Env[Any, Any]],
    env_name: str,
    store: Store,
    tokenizer: Any,
    episodes: int,
    score: Score,
    *,
    version: int = 0,
    seed: int = 0,
    context_length: int | None = None,
    expand: Expand | None = None,
) -> list[EpisodeSummary]:
    """Plays `episodes` episodes of the env with its reference agent, each on a different
    task of its split while there are tasks left (a seeded shuffle), and stores them as
    demonstrations of `env_name` (the sessions' env id). Returns their summaries, which say
    why each one failed (`end_reason`); failed demonstrations are stored too, with their
    outcome and end reason, and the caller chooses.

    Raises:
        NoReferenceAgent: the env has no scripted solver, or one for none of the tasks it
            played.
    """
    play = ReferencePlay(make_env())
    try:
        if getattr(type(play.unwrapped), "reference_agent", None) in (
            None,
            AgentEnv.reference_agent,
        ):
            raise NoReferenceAgent(
                f"env {env_name!r} ({type(play.unwrapped).__name__}) has no reference agent "
                "to demonstrate its tasks; give demonstrations as a parquet export instead"
            )
        ids = list(play.unwrapped.task_ids())  # type: ignore[attr-defined]
        random.Random(seed).shuffle(ids)
        seat = DemonstrationSeat(
            ScriptedPolicy(play, tokenizer, score, version, context_length, expand), store
        )
        summaries = [
            run_episode(play, seat, env_id=env_name, task_id=ids[n % len(ids)], seed=seed + n)
            for n in range(episodes)
        ]
        if play.agentless == len(summaries):
            raise NoReferenceAgent(
                f"env {env_name!r}: no reference agent for any of the {len(summaries)} "
                f"tasks played (the first: {end_reason(summaries[0])})"
            )
        unsolved = [s for s in summaries if not solved(s.total_reward)]
        logger.info(
            "%s: %d demonstrations, %d solved, %d not played%s",
            env_name,
            len(summaries),
            len(summaries) - len(unsolved),
            sum(not s.session_id for s in summaries),
            f"; the first unsolved: {end_reason(unsolved[0])}" if unsolved else "",
        )
        return summaries
    finally:
        play.close()


def end_reason(summary: EpisodeSummary) -> str:
    """How a demonstration's episode ended: what cut it short (the text of the error that
    broke it, a refused request, the context, an env that would not reset), else how the
    env ended it and the reward it gave."""
    if summary.error is not None:
        return summary.error
    end = TERMINATED if summary.terminated else MAX_TURNS
    return f"the env ended it ({end}) with reward {summary.total_reward:.2f}"


def import_parquet(store: Store, path: str | Path) -> int:
    """Copies the sessions of a store's parquet export (`Store.export_parquet`) into `store`
    as demonstrations, token ids and all; returns the number of turns. Sessions already in
    the store are left as they are (an import repeated on resume adds nothing)."""
    import datasets

    rows = datasets.Dataset.from_parquet(str(path))
    by_session: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], []).append(row)
    known = {s.session_id for s in store.sessions(session_ids=list(by_session))}
    count = 0
    for session_id, turns in by_session.items():
        if session_id in known:
            continue
        first = turns[0]
        store.add_session(
            Session(
                session_id,
                first["env_id"],
                task_id=first["task_id"],
                group_id=first["group_id"],
                metadata={DEMONSTRATION: f"parquet:{path}"},
            )
        )
        for row in sorted(turns, key=lambda r: r["index"]):
            store.add_turn(_turn_of_row(row))
            count += 1
        store.finish_session(session_id, first["outcome_reward"], SessionStatus.DONE)
    logger.info("imported %d turns of %d sessions from %s", count, len(by_session), path)
    return count


def _turn_of_row(row: Mapping[str, Any]) -> Turn:
    judged = row["score"] is not None or row["hint"] is not None
    return Turn(
        session_id=row["session_id"],
        index=int(row["index"]),
        turn_type=TurnType(row["turn_type"]),
        prompt_messages=tuple(json.loads(row["prompt_messages"])),
        prompt_token_ids=tuple(row["prompt_token_ids"]),
        completion_token_ids=tuple(row["completion_token_ids"]),
        completion_logprobs=tuple(row["completion_logprobs"]),
        # exports written before schema 3 have no top-k columns
        completion_top_ids=tuple(tuple(top) for top in row.get("completion_top_ids") or ()),
        completion_top_logprobs=tuple(
            tuple(top) for top in row.get("completion_top_logprobs") or ()
        ),
        completion=json.loads(row["completion"]),
        policy_version=int(row["policy_version"]),
        tools=tuple(json.loads(row["tools"])),
        next_state=None if row["next_state"] is None else tuple(json.loads(row["next_state"])),
        env_reward=row["env_reward"],
        judgement=Judgement(tuple(row["votes"]), row["score"] or 0.0, row["hint"])
        if judged
        else None,
        created_at=row["created_at"],
    )
