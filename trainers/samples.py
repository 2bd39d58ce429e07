"""From judged turns to training samples, per method (docs/architecture.md, "Learning methods").

A turn's reward mixes the judge's per-step score and its episode's outcome reward with its
env's weights (`RewardWeights`, `advantages.mix_rewards`); in a mixture each session's env
has its own. With several rollouts of one task in a batch, the reward is centred over the
turns of that group at the same step index (OpenClaw-RL's step-wise baseline;
`method.baseline=group` centres over all the group's turns); a live conversation, alone in
its group, keeps its raw reward. Turns that carry
no signal under the method, or that come from an adapter older than `max_staleness`
versions, are dropped: consumed, never trained.

A group of several rollouts with no signal at all (every reward equal to its baseline's
mean; opd and combine: no hint either) is dropped whole with `method.filter_groups`
(dynamic sampling, DAPO); without it, binary trains its turns at advantage 0. Either way
`Selection.groups` says which groups had a signal, for the run's watch on them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agents.config import EnvConfig
from agents.trajectory import Message, Session, Turn
from agents.vision import BadImage, images_of
from trainers.advantages import (
    combine_advantages,
    group_baseline,
    is_stale,
    mix_rewards,
    opd_advantages,
)
from trainers.config import LEARNER_TEACHER, TOPK, MethodConfig
from trainers.experience import NOTES_KEY, with_experience
from trainers.judge import with_hint
from trainers.learning import TrainSample

logger = logging.getLogger(__name__)

Encode = Callable[[Sequence[Message], Sequence[Any] | None], list[int]]
"""An engine's `encode`: a conversation's prompt ids, ending with the generation prompt."""


@dataclass(frozen=True)
class GroupSignal:
    """Whether a group of several rollouts of one task gives the method anything to learn."""

    group_id: str
    env_id: str
    signal: bool
    """binary and combine: some turn's reward differs from its baseline's mean; opd and
    combine: the judge accepted a hint for some turn."""
    rewards: tuple[float, ...]
    """The distinct rewards of its turns, sorted; empty where no turn had one."""
    session_id: str
    """Its first episode (the session of its oldest turn)."""


@dataclass(frozen=True)
class Selection:
    """What a batch of judged turns becomes."""

    samples: tuple[TrainSample, ...]
    dropped: tuple[int, ...]
    """Sequence numbers of turns consumed without training."""
    stale: int
    """How many of the dropped were too old."""
    groups: tuple[GroupSignal, ...] = ()
    """The groups of several rollouts among the fresh turns, in the order of their last turn."""


@dataclass(frozen=True)
class RewardWeights:
    """How one env's turns turn the judge's score and the episode's outcome into a reward;
    a weight of 0 leaves that part out."""

    judge: float = 1.0
    outcome: float = 0.0


def reward_weights(env: EnvConfig | None, method: MethodConfig, judge_kind: str) -> RewardWeights:
    """The weights of an env's turns (None: live conversations, which have no outcome).

    A judge that is the outcome (`env`) is taken as the outcome itself, once, with the
    judge's weight: its score is the outcome's sign, and on a 0/1 task a failure's sign is
    0, which reads as a tie (no signal); a group of three solved and one failed rollouts
    would then have no contrast left to learn from. The outcome's 0 is signal.
    """
    judge = (env.judge_weight if env else 1.0) if method.use_judge else 0.0
    outcome = (env.outcome_weight if env else 0.0) if method.use_env_reward else 0.0
    if judge_kind == "env" and judge:
        return RewardWeights(0.0, judge)
    return RewardWeights(judge, outcome)


def turn_reward(turn: Turn, session: Session, weights: RewardWeights) -> float | None:
    """The scalar reward of one turn, or None when it has no signal."""
    judge_score = turn.judgement.score if (weights.judge and turn.judgement) else None
    outcome = session.outcome_reward if weights.outcome else None
    return mix_rewards(judge_score, outcome, weights.judge, weights.outcome)


def select(
    judged: Sequence[tuple[int, Turn]],
    sessions: Mapping[str, Session],
    method: MethodConfig,
    *,
    weights: Mapping[str, RewardWeights],
    current_version: int,
    max_staleness: int,
    encode: Encode | None = None,
) -> Selection:
    """Training samples from judged turns, with the seqs of those dropped. `weights` are
    looked up by each session's env id; a session of no listed env (a live one) takes
    `RewardWeights()`. `encode` renders the hinted teacher's prompt for the top-k methods
    (the engine's `encode`, as the judge's teacher renders it)."""
    if method.name in LEARNER_TEACHER and encode is None:
        raise ValueError(f"method={method.name} needs `encode` for the teacher's prompt")
    fresh = [
        (s, t) for s, t in judged if not is_stale(t.policy_version, current_version, max_staleness)
    ]
    dropped = [s for s, t in judged if is_stale(t.policy_version, current_version, max_staleness)]
    rewards = {}
    for seq, turn in fresh:
        session = sessions[turn.session_id]
        rewards[seq] = turn_reward(turn, session, weights.get(session.env_id, RewardWeights()))
    centred = _centred(fresh, rewards, sessions, method)
    groups = group_signals(fresh, rewards, centred, sessions, method)
    several = {g.group_id for g in groups}
    silent = {g.group_id for g in groups if not g.signal}
    samples = []
    for seq, turn in fresh:
        group = sessions[turn.session_id].group_id
        keep_zero = group in several and not method.filter_groups
        try:
            if method.name in TOPK:
                assert encode is not None  # checked above
                sample = topk_sample(seq, turn, centred.get(seq), method, encode)
            elif method.name == "oel":
                assert encode is not None
                sample = oel_sample(seq, turn, sessions[turn.session_id], encode)
            else:
                advantages = _advantages(turn, rewards[seq], centred.get(seq), method, keep_zero)
                sample = None if advantages is None else _sample(seq, turn, advantages)
        except BadImage as bad:  # only an imported turn can hold one: the proxy refuses them
            logger.warning("turn %d dropped: its prompt's image cannot be read: %s", seq, bad)
            sample = None
        if sample is None or (method.filter_groups and group in silent):
            dropped.append(seq)
            continue
        samples.append(sample)
    return Selection(tuple(samples), tuple(dropped), len(judged) - len(fresh), groups)


def _sample(seq: int, turn: Turn, advantages: torch.Tensor) -> TrainSample:
    return TrainSample(
        seq=seq,
        prompt_ids=turn.prompt_token_ids,
        completion_ids=turn.completion_token_ids,
        rollout_logprobs=turn.completion_logprobs,
        advantages=tuple(advantages.tolist()),
        policy_version=turn.policy_version,
        # any size: the request's limits admitted them when the turn was sampled
        images=tuple(images_of(turn.prompt_messages, None)),
    )


def topk_sample(
    seq: int, turn: Turn, centred: float | None, method: MethodConfig, encode: Encode
) -> TrainSample | None:
    """A top-k method's sample, by combine's table: a hint gives the top-k distillation
    term (the hinted teacher's prompt and the old student's top-k) plus w_rl * reward on
    every token; no hint, the reward term alone; no hint and no reward (or topk_opd's
    w_rl 0), dropped. A hinted turn stored without k top log-probs (sampled before the
    proxy kept them) counts as unhinted."""
    reward = method.w_rl * (centred or 0.0)
    hint = turn.judgement.hint if turn.judgement else None
    stored = len(turn.completion_top_ids[0]) if turn.completion_top_ids else 0
    if hint is not None and stored < method.k:
        logger.warning(
            "turn %s/%d keeps %d top log-probs, method.k=%d needs more: trained without its "
            "hint (serve.top_logprobs sets what the proxy keeps)",
            turn.session_id,
            turn.index,
            stored,
            method.k,
        )
        hint = None
    rl = torch.full((len(turn.completion_token_ids),), reward)
    if hint is None:
        return None if reward == 0 else _sample(seq, turn, rl)
    teacher_prompt = encode(with_hint(turn.prompt_messages, hint), turn.tools or None)
    return dataclasses.replace(
        _sample(seq, turn, rl),
        teacher_prompt_ids=tuple(teacher_prompt),
        top_ids=tuple(ids[: method.k] for ids in turn.completion_top_ids),
        top_logprobs=tuple(values[: method.k] for values in turn.completion_top_logprobs),
    )


def oel_sample(seq: int, turn: Turn, session: Session, encode: Encode) -> TrainSample | None:
    """An experience-distillation sample: the teacher's prompt is the turn's with its
    session's notes (`trainers.experience`), no advantage (the loss is the reverse KL to
    that teacher alone); None when the session's notes are empty."""
    notes = session.metadata.get(NOTES_KEY)
    if not notes:
        return None
    teacher_prompt = encode(with_experience(turn.prompt_messages, notes), turn.tools or None)
    zeros = torch.zeros(len(turn.completion_token_ids))
    return dataclasses.replace(_sample(seq, turn, zeros), teacher_prompt_ids=tuple(teacher_prompt))


def group_signals(
    turns: Sequence[tuple[int, Turn]],
    rewards: Mapping[int, float | None],
    centred: Mapping[int, float],
    sessions: Mapping[str, Session],
    method: MethodConfig,
) -> tuple[GroupSignal, ...]:
    """Each group of several rollouts among `turns` (sessions sharing a group id in
    `sessions`), in the order of its last turn, with whether it carries a signal."""
    sizes = Counter(s.group_id for s in sessions.values() if s.group_id)
    members: dict[str, list[tuple[int, Turn]]] = {}
    for seq, turn in turns:
        group = sessions[turn.session_id].group_id
        if group and sizes[group] > 1:
            members.setdefault(group, []).append((seq, turn))
    signals = []
    for group, grouped in sorted(members.items(), key=lambda item: max(s for s, _ in item[1])):
        hinted = method.name != "binary" and any(
            t.judgement is not None and t.judgement.teacher_logprobs is not None for _, t in grouped
        )
        if method.name == "oel":  # the notes are its signal
            hinted = any(sessions[t.session_id].metadata.get(NOTES_KEY) for _, t in grouped)
        contrast = method.name not in ("opd", "topk_opd") and any(
            centred.get(s) for s, _ in grouped
        )
        values = sorted({r for s, _ in grouped if (r := rewards[s]) is not None})
        first = grouped[0][1].session_id
        env = sessions[first].env_id
        signals.append(GroupSignal(group, env, hinted or contrast, tuple(values), first))
    return tuple(signals)


def baseline_key(turn: Turn, session: Session, baseline: str = "step") -> tuple[str, int]:
    """The baseline group of a turn: the rollouts of its task at the same turn index
    (`step`), or all their turns (`group`)."""
    return (session.group_id or turn.session_id, turn.index if baseline == "step" else 0)


def _centred(
    turns: Sequence[tuple[int, Turn]],
    rewards: Mapping[int, float | None],
    sessions: Mapping[str, Session],
    method: MethodConfig,
) -> dict[int, float]:
    """Rewards minus their baseline group's mean; turns without reward are left out."""
    rated = [(s, t) for s, t in turns if rewards[s] is not None]
    if not rated:
        return {}
    keys = [baseline_key(t, sessions[t.session_id], method.baseline) for _, t in rated]
    values = torch.tensor([float(rewards[s] or 0.0) for s, _ in rated])
    centred = group_baseline(values, keys, method.scale_by_std)
    return {s: float(a) for (s, _), a in zip(rated, centred, strict=True)}


def _advantages(
    turn: Turn,
    reward: float | None,
    centred: float | None,
    method: MethodConfig,
    keep_zero: bool = False,
) -> torch.Tensor | None:
    rollout = torch.tensor(turn.completion_logprobs)
    teacher = turn.judgement.teacher_logprobs if turn.judgement else None
    teacher_tensor = None if teacher is None else torch.tensor(teacher)
    if method.name == "binary":
        # A zero advantage (a uniform group) trains on nothing: dropped, unless the step
        # takes whole groups as they come (`keep_zero`, DAPO's baseline without filtering).
        if centred is None or (centred == 0 and not keep_zero):
            return None
        return torch.full_like(rollout, centred)
    if method.name == "opd":
        if teacher_tensor is None:
            return None
        return opd_advantages(teacher_tensor, rollout, method.diff_clip)
    score = 0.0 if centred is None else centred
    return combine_advantages(
        rollout, teacher_tensor, score, method.w_opd, method.w_rl, method.diff_clip
    )


def first_batch(
    samples: Sequence[TrainSample], keys: Mapping[int, Hashable], size: int
) -> tuple[TrainSample, ...]:
    """The oldest samples of whole baseline groups, at least `size` of them (all if fewer).

    `keys[seq]` is a sample's baseline group: the rollouts whose mean was subtracted from
    its reward. A step takes whole groups so that turns it leaves for later keep the
    baseline they were centred with.
    """
    buckets: dict[Hashable, list[TrainSample]] = {}
    for sample in samples:
        buckets.setdefault(keys[sample.seq], []).append(sample)
    batch: list[TrainSample] = []
    for bucket in buckets.values():
        if len(batch) >= size:
            break
        batch += bucket
    return tuple(batch)
