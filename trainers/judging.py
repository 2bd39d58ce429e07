"""The judging loop: reads collected main turns from the store, asks each one's judge (the
judge of its session's env, else the run's), and stores the judgement. With `method=oel`
a turn waits for its session to end, whose experience notes are written first
(`trainers.experience`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from agents.store import Store
from agents.trajectory import TurnStatus, TurnType
from trainers.experience import ExperienceWriter
from trainers.judge import Judge
from trainers.progress import Progress

_IDLE_POLL_S = 0.25


class JudgeLoop:
    """Judges turns as they settle.

    Args:
        store: the run's store.
        judge: the run's judge.
        by_env: judges of particular envs (`env.<name>.judge`), by the env's name.
        want_hint: whether the method trains on hints (opd, combine).
        progress: where judged turns and scores are counted.
        experience: writes each ended session's notes (`method=oel`); None: no notes.
    """

    def __init__(
        self,
        store: Store,
        judge: Judge,
        by_env: Mapping[str, Judge],
        want_hint: bool,
        progress: Progress,
        experience: ExperienceWriter | None = None,
    ):
        self.store, self.judge, self.by_env = store, judge, dict(by_env)
        self.want_hint, self.progress, self.experience = want_hint, progress, experience

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.judge_pending(stop):
                time.sleep(_IDLE_POLL_S)

    def judge_pending(self, stop: threading.Event | None = None) -> bool:
        """Judges the collected main turns that can be judged now; True if any were."""
        # settled turns only: a window of turns still waiting for their next state (live
        # users who have not answered yet) would hold back every turn behind it
        pending = self.store.turns(
            status=TurnStatus.COLLECTED, turn_type=TurnType.MAIN, limit=256, settled=True
        )
        sessions = {
            s.session_id: s
            for s in self.store.sessions(session_ids={t.session_id for _, t in pending})
        }
        judged = 0
        notes: dict[str, str | None] = {}
        for _, turn in pending:
            if stop is not None and stop.is_set():
                break
            if self.experience is not None:
                if turn.session_id not in notes:
                    notes[turn.session_id] = self.experience.notes(turn.session_id)
                if notes[turn.session_id] is None:
                    continue  # its session goes on: no notes to learn from yet
            session = sessions[turn.session_id]
            judge = self.by_env.get(session.env_id, self.judge)
            judgement = judge.judge(turn, session, self.want_hint)
            if judgement is not None:
                self.store.set_judgement(turn.session_id, turn.index, judgement)
                self.progress.recent_judge_scores.append(judgement.score)
                judged += 1
        self.progress.turns_judged += judged
        return judged > 0
