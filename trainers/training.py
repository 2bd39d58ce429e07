"""The training loop's step: once enough judged turns of complete groups are in the store,
select samples by the method (each session's env with its own reward weights), take one
optimiser step, checkpoint (with the step's metrics), mark the turns, publish the adapter,
and write the run's and each env's metrics."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

from agents.config import EnvConfig
from agents.store import Store
from agents.trajectory import Judgement, Session, SessionStatus, Turn, TurnStatus, TurnType
from trainers.config import HINTED, MethodConfig, TrainerConfig
from trainers.diagnostics import RewardGroups, mean_abs, nonzero_share, variance_share
from trainers.learning import PolicyLearner, StepMetrics, TrainSample
from trainers.metrics import CHECKPOINT_KEY, MetricsWriter, Record, record
from trainers.progress import Progress, episode_summary
from trainers.samples import (
    Encode,
    GroupSignal,
    RewardWeights,
    Selection,
    baseline_key,
    first_batch,
    select,
    turn_reward,
)

logger = logging.getLogger(__name__)

Publish = Callable[[str, int], None]


class TrainLoop:
    """Takes optimiser steps from the store's judged turns.

    Args:
        trainer: the learner's and loop's config (batch size, staleness).
        method: how judged turns become advantages.
        envs: the run's envs by name (their group sizes); sessions of any other env (live
            conversations) are groups of one.
        weights: each env's reward weights, by name.
        learner: the LoRA learner.
        store: the run's store.
        publish: hands a new adapter version to the server.
        progress: the run's counters.
        metrics: where each step's rows go.
        run_dir: the run directory (adapters live under it).
        max_signalless_groups: groups of one env in a row without a learning signal before
            the run stops (`SignalWatch`); 0: never.
        encode: the engine's `encode` (the top-k methods render the hinted teacher's
            prompt with it).
        choose_hint: chooses among a turn's hint candidates (`trainers.hint_choice`; the
            judge's `hint_selection=overlap` leaves that to the learner); None: no such turns.
    """

    def __init__(
        self,
        trainer: TrainerConfig,
        method: MethodConfig,
        envs: Mapping[str, EnvConfig],
        weights: Mapping[str, RewardWeights],
        learner: PolicyLearner,
        store: Store,
        publish: Publish,
        progress: Progress,
        metrics: MetricsWriter | None,
        run_dir: Path,
        max_signalless_groups: int = 0,
        encode: Encode | None = None,
        choose_hint: Callable[[Turn], Judgement] | None = None,
    ):
        self.trainer, self.method, self.envs, self.weights = trainer, method, envs, weights
        self.learner, self.store, self.publish = learner, store, publish
        self.progress, self.metrics, self.run_dir = progress, metrics, Path(run_dir)
        self.encode, self.choose_hint = encode, choose_hint
        self.in_training = 0
        """Turns of the batch the learner is on (still judged in the store until done)."""
        self._started = time.monotonic()
        self._reward_groups = RewardGroups()
        """The baseline groups' rewards seen since the last step (`group_variance_share`)."""
        self.watch = SignalWatch(
            max_signalless_groups, self._episode_end, hints=method.name in HINTED
        )
        self._seen_groups: set[str] = set()
        """The groups the last selection held (a group left for a later step is seen once)."""
        self._filtered: dict[str, int] = {}
        """Groups `method.filter_groups` dropped since the last step, by env."""
        self._selecting = threading.Lock()
        """A step's selection against `prune`'s (the rollout loop's thread)."""
        self._pruned = (0, 0)
        """The judged turns and policy version the last `prune` left."""

    def waiting(self) -> int:
        """Turns waiting to be trained, less the batch being trained (the rollout plays
        the next batch meanwhile)."""
        # main turns only: side turns (held-out evaluation, a client's side requests) are
        # never judged and would fill the backlog for good
        return (
            self.store.count_turns(TurnStatus.COLLECTED, TurnType.MAIN)
            + self.store.count_turns(TurnStatus.JUDGED, TurnType.MAIN)
            - self.in_training
        )

    def has_room(self) -> bool:
        """Whether fewer than `trainer.backlog` turns wait (the rollout loop's pause). A
        backlog that looks full first loses what no step would train (`prune`): with
        `method.filter_groups` most groups of a weak policy carry no signal, and while the
        learner is busy (a step, an evaluation) they filled the backlog and stopped the
        rollouts, which then started the next batch only when the learner wanted it."""
        if self.waiting() < self.trainer.backlog:
            return True
        self.prune()
        return self.waiting() < self.trainer.backlog

    def prune(self) -> None:
        """Drops the ready turns the next step would drop (complete groups without signal
        under `method.filter_groups`, turns past `trainer.max_staleness`), training
        nothing. Not where a step chooses among hint candidates first: that choice is the
        step's to make. Only where something changed since the last pruning (turns judged,
        a new version): a full backlog of turns it keeps is polled four times a second."""
        state = (self.store.count_turns(TurnStatus.JUDGED), self.learner.version)
        if self.choose_hint is not None or not state[0] or state == self._pruned:
            return
        with self._selecting:
            self._select(*self._ready_turns())
        self._pruned = (self.store.count_turns(TurnStatus.JUDGED), self.learner.version)

    def step(self) -> StepMetrics | None:
        """One optimiser step if enough judged turns are ready; None otherwise."""
        # a COUNT first: loading and decoding the judged turns on every poll took a third
        # of a core and the GIL from the engine thread while a batch filled up
        if self.store.count_turns(TurnStatus.JUDGED) < self.trainer.batch_turns:
            return None
        with self._selecting:
            ready, sessions = self._ready_turns()
            if len(ready) < self.trainer.batch_turns:
                return None
            ready = self._choose_hints(ready)
            selection = self._select(ready, sessions)
        if len(selection.samples) < self.trainer.batch_turns:
            return None
        # `batch_turns` a step; the rest stay judged for the next one
        keys = {
            seq: baseline_key(turn, sessions[turn.session_id], self.method.baseline)
            for seq, turn in ready
        }
        batch = first_batch(selection.samples, keys, self.trainer.batch_turns)
        return self._train(list(batch), selection, ready, sessions)

    def _select(self, ready: list[tuple[int, Turn]], sessions: Mapping[str, Session]) -> Selection:
        """The method's samples from the ready turns; what it drops is marked dropped at
        once: their groups are complete, so no later turn gives them a signal (and
        staleness only grows), and left judged they would fill the backlog."""
        selection = select(
            ready,
            sessions,
            self.method,
            weights=self.weights,
            current_version=self.learner.version,
            max_staleness=self.trainer.max_staleness,
            encode=self.encode,
        )
        self.store.mark_trained(selection.dropped, TurnStatus.DROPPED)
        self.progress.turns_dropped += len(selection.dropped)
        env_of = {seq: sessions[turn.session_id].env_id for seq, turn in ready}
        for seq in selection.dropped:
            self.progress.env(env_of[seq]).turns_dropped += 1
        self._watch(selection.groups)
        return selection

    def _train(
        self,
        batch: list[TrainSample],
        selection: Selection,
        ready: list[tuple[int, Turn]],
        sessions: Mapping[str, Session],
    ) -> StepMetrics:
        """The optimiser step on `batch`, its checkpoint, the publish and the metrics."""
        env_of = {seq: sessions[turn.session_id].env_id for seq, turn in ready}
        staleness_by_env: dict[str, list[int]] = {}
        for sample in batch:
            staleness_by_env.setdefault(env_of[sample.seq], []).append(
                self.learner.version - sample.policy_version
            )
        self.in_training = len(batch)
        try:
            metrics = self.learner.step(batch)
            adapter = self.learner.save_adapter()
            # the step's metrics go into its checkpoint: a kill before they reach
            # metrics.jsonl below loses no row (`trainers.metrics` says the rule)
            with self._selecting:  # the tallies `prune` adds to from the rollout's thread
                records = self._records(
                    metrics, batch, selection, ready, sessions, staleness_by_env
                )
                records = self._with_filtered(records)
            self.learner.save_checkpoint(
                {
                    "trained_turns": self.progress.turns_trained + len(batch),
                    CHECKPOINT_KEY: records,
                }
            )
            self.store.mark_trained([s.seq for s in batch])
        finally:
            self.in_training = 0
        published = time.perf_counter()
        self.publish(str(adapter), self.learner.version)
        publish_ms = round((time.perf_counter() - published) * 1e3, 2)
        self.progress.turns_trained += len(batch)
        self.progress.steps.append(metrics)
        for sample in batch:
            self.progress.env(env_of[sample.seq]).turns_trained += 1
        if self.metrics is not None:
            # the step's own row is the first; the checkpoint's copy lacks only publish_ms
            self.metrics.write_records([records[0] | {"publish_ms": publish_ms}, *records[1:]])
        logger.info(
            "step %d: loss %.4f, %d turns, reward %.3f, %.1fs, published in %.0f ms",
            metrics.step,
            metrics.loss,
            metrics.turns,
            self.progress.mean_recent_reward,
            metrics.seconds,
            publish_ms,
        )
        return metrics

    def _choose_hints(self, ready: list[tuple[int, Turn]]) -> list[tuple[int, Turn]]:
        """`ready` with a hint chosen for each turn whose judge left several candidates to
        the learner, each choice stored with the turn (made once)."""
        chosen = []
        for seq, turn in ready:
            if turn.judgement is not None and turn.judgement.awaits_hint_choice:
                if self.choose_hint is None:
                    raise ValueError("turns await a hint choice: give the loop `choose_hint`")
                judgement = self.choose_hint(turn)
                self.store.set_judgement(turn.session_id, turn.index, judgement)
                turn = turn.replace(judgement=judgement)
            chosen.append((seq, turn))
        return chosen

    def _ready_turns(self) -> tuple[list[tuple[int, Turn]], dict[str, Session]]:
        """Judged main turns whose whole group is finished and judged (for the baseline),
        their rewards tallied by baseline group for the next step's row."""
        judged = self.store.turns(status=TurnStatus.JUDGED, turn_type=TurnType.MAIN)
        sessions = {
            s.session_id: s
            for s in self.store.sessions(session_ids={t.session_id for _, t in judged})
        }
        groups = {s.group_id for s in sessions.values() if s.group_id}
        members = self.store.group_sessions(groups)
        sessions |= {s.session_id: s for s in members}
        unjudged = {
            t.session_id
            for _, t in self.store.turns(status=TurnStatus.COLLECTED, turn_type=TurnType.MAIN)
        }
        complete = set()
        for group in groups:
            mates = [s for s in members if s.group_id == group]
            env = self.envs.get(mates[0].env_id) if mates else None
            size = env.group_size if env is not None else 1
            finished = all(
                s.status != SessionStatus.OPEN and s.session_id not in unjudged for s in mates
            )
            if finished and len(mates) >= size:
                complete.add(group)
        ready = [
            (q, t) for q, t in judged if (sessions[t.session_id].group_id or "") in complete | {""}
        ]
        # every poll, not only a step's: a group filtered out is dropped at the first
        self._reward_groups.see(self._rewards(ready, sessions))
        return ready, sessions

    def _rewards(
        self, turns: list[tuple[int, Turn]], sessions: Mapping[str, Session]
    ) -> list[tuple[tuple[str, int], int, float | None]]:
        """Each turn's baseline group, seq and reward, as `select` reckons them."""
        rewarded = []
        for seq, turn in turns:
            session = sessions[turn.session_id]
            weights = self.weights.get(session.env_id, RewardWeights())
            key = baseline_key(turn, session, self.method.baseline)
            rewarded.append((key, seq, turn_reward(turn, session, weights)))
        return rewarded

    def _watch(self, groups: Sequence[GroupSignal]) -> None:
        """Counts the groups a selection holds for the first time: those filtered out, and
        each one in the watch for a run of groups without signal (which may stop the run)."""
        new = [g for g in groups if g.group_id not in self._seen_groups]
        self._seen_groups = {g.group_id for g in groups}
        for group in new:
            if self.method.filter_groups and not group.signal:
                self._filtered[group.env_id] = self._filtered.get(group.env_id, 0) + 1
            self.watch.see(group)

    def _with_filtered(self, records: list[Record]) -> list[Record]:
        """The step's records with `filtered_groups`, the groups dropped since the last step
        (`method.filter_groups`): their total in the run's row, each env's in its own."""
        filtered, self._filtered = self._filtered, {}
        total = sum(filtered.values())
        return [
            r | {"filtered_groups": filtered.get(r["env"], 0) if "env" in r else total}
            for r in records
        ]

    def _episode_end(self, session_id: str) -> str:
        """How an episode ended, for a message: its status, why (its `end_reason`) and the
        gist of its last observation."""
        session = self.store.session(session_id)
        end = f"{session.status} ({session.metadata.get('end_reason') or 'no reason stored'})"
        main = [t for t in session.turns if t.turn_type == TurnType.MAIN]
        last = main[-1].next_state if main else None
        if last:
            gist = " ".join(str(last[-1].get("content") or "").split())
            end += f", last observation {gist[:160]!r}"
        return end

    def _records(
        self,
        metrics: StepMetrics,
        batch: Sequence[TrainSample],
        selection: Selection,
        ready: list[tuple[int, Turn]],
        sessions: Mapping[str, Session],
        staleness_by_env: Mapping[str, list[int]],
    ) -> list[Record]:
        """The step's records for metrics.jsonl: the run's row, then one per env. The row
        has the learner's `StepMetrics` and whether the step had anything to learn from:
        `group_variance_share` (of the baseline groups seen since the last step, those whose
        rewards differ), `nonzero_advantage_share` (of the trained turns) and
        `mean_abs_advantage` (over the trained tokens)."""
        advantages = [s.advantages for s in batch]
        share = variance_share(self._reward_groups.take())
        self.progress.group_variance_share = share  # the progress bar's
        scores_by_env: dict[str, list[float]] = {}
        for _, turn in ready:
            if turn.judgement is not None:
                env = sessions[turn.session_id].env_id
                scores_by_env.setdefault(env, []).append(turn.judgement.score)
        row = asdict(metrics) | {
            "elapsed_s": round(time.monotonic() - self._started, 3),
            "rollout_tokens": self.progress.rollout_tokens,
            "judge_score": _mean(sum(scores_by_env.values(), [])),
            "dropped": len(selection.dropped),
            "stale": selection.stale,
            "episodes": self.progress.episodes,
            "recent_reward": self.progress.mean_recent_reward,
            "group_variance_share": _rounded(share),
            "nonzero_advantage_share": _rounded(nonzero_share(advantages)),
            "mean_abs_advantage": _rounded(mean_abs(advantages)),
        }
        dropped_by_env: dict[str, int] = {}
        env_of = {seq: sessions[turn.session_id].env_id for seq, turn in ready}
        for seq in selection.dropped:
            dropped_by_env[env_of[seq]] = dropped_by_env.get(env_of[seq], 0) + 1
        considered_by_env: dict[str, int] = {}
        for env in env_of.values():
            considered_by_env[env] = considered_by_env.get(env, 0) + 1
        records = [record(metrics.step, row)]
        for name in dict.fromkeys([*self.envs, *considered_by_env]):
            considered = considered_by_env.get(name, 0)
            staleness = staleness_by_env.get(name, [])
            env_row = episode_summary(self.progress.env(name).unreported()) | {
                "judge_score": _mean(scores_by_env.get(name, [])),
                "turns_trained": len(staleness),
                "dropped": dropped_by_env.get(name, 0),
                "dropped_share": (
                    round(dropped_by_env.get(name, 0) / considered, 4) if considered else None
                ),
                "staleness": _mean([float(s) for s in staleness]),
            }
            records.append(record(metrics.step, env_row, env=name))
        return records


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


class SignalWatch:
    """Stops a run once one env's groups of several rollouts have carried no learning signal
    (`samples.GroupSignal`) `limit` times in a row: a policy that never solves a task (say,
    its warm start failed) or always does gives every rollout of a group the same reward,
    and would otherwise play on forever learning nothing. Counted per env in the order the
    groups are seen; a group with a signal starts its env's count again.

    Args:
        limit: signal-less groups in a row before the run stops; 0: never.
        describe: how an episode ended (its session id's), for the message.
        hints: the method also learns from hints (opd, combine), so a signal-less group had
            none accepted either.
    """

    def __init__(self, limit: int, describe: Callable[[str], str], hints: bool = False):
        self.limit, self.describe, self.hints = limit, describe, hints
        self.first: dict[str, GroupSignal] = {}
        """The first group of each env's current run of signal-less groups."""
        self.counts: dict[str, int] = {}
        """How long each env's current run is."""

    def see(self, group: GroupSignal) -> None:
        """Counts `group`; raises RuntimeError when its env's run reaches `limit`."""
        if group.signal:
            self.first.pop(group.env_id, None)
            self.counts.pop(group.env_id, None)
            return
        first = self.first.setdefault(group.env_id, group)
        count = self.counts[group.env_id] = self.counts.get(group.env_id, 0) + 1
        if self.limit and count >= self.limit:
            hint = ", no hint accepted" if self.hints else ""
            raise RuntimeError(
                f"env {group.env_id!r}: {count} groups in a row scored the same "
                f"({_same(first.rewards)}{hint}), nothing to learn from; the first one's "
                f"first episode ended {self.describe(first.session_id)}. Does the policy fail "
                "(or solve) every task, after a warm start that failed, say? "
                "rollout.max_signalless_groups=0 plays on regardless"
            )


def _same(rewards: tuple[float, ...]) -> str:
    """What a signal-less group's rewards were, in words."""
    if not rewards:
        return "no turn had a reward"
    if len(rewards) == 1:
        return f"every reward {rewards[0]}"
    return f"rewards {', '.join(map(str, rewards))}, each equal to its step's mean"
