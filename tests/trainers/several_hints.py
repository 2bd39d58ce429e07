"""A judge for the runs that choose among hint candidates (`judge.kind=tests.trainers.
several_hints:SeveralHints`): the feedback judge's reading of the user's reply, and beside
a complaint's own instruction two more candidates such as a capable judge model writes. A
stand-in for that judge model, which cannot run on a CPU machine (the tiny policy writes
no hints), so that a run exercises the learner's choice among several."""

from __future__ import annotations

from agents.engines.base import Engine
from agents.trajectory import Judgement, Session, Turn
from trainers.distillation import accepted_hints
from trainers.judge import FeedbackJudge, hinted_judgement
from trainers.judge_config import JudgeConfig

MORE = ("Reply in one short sentence.", "Answer the user's question directly and politely.")


class SeveralHints:
    def __init__(self, config: JudgeConfig, engine: Engine):
        self.config, self.engine = config, engine
        self.feedback = FeedbackJudge(config, engine)

    def judge(self, turn: Turn, session: Session, want_hint: bool) -> Judgement | None:
        judgement = self.feedback.judge(turn, session, want_hint)
        if judgement is None or judgement.score != -1 or not want_hint:
            return judgement
        votes = [(1, hint) for hint in (*judgement.hint_candidates, *MORE)]
        candidates = accepted_hints(votes, self.config.hint_min_chars)
        selection = self.config.hint_selection
        return hinted_judgement(
            judgement.votes, judgement.score, candidates, selection, self.engine, turn
        )
