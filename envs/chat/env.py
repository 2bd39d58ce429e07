"""`clawgym/Chat-v0`: a personal-agent conversation with a simulated user who has a persona.

The user asks a few questions, one at a time, and answers each assistant reply as a
person would (see `envs.chat.user`): satisfied and moving on, correcting ("too long, just
give me the answer"), asking again, or giving up on a question. The episode terminates
when the user is done with their last question, and is truncated when the turn budget
runs out. No tools: a plain-text reply is the action.

Rewards. The env's reward is always 0: this env's training signal is the judge's reading
of the user's next message (docs/architecture.md, "Learning methods"). The persona's programmatic
preference score (`envs.chat.personas`) is ground truth for EVALUATION ONLY, exposed in
`info`, never as reward:

- `info["preference_score"]`: the score in [0, 1] of this step's reply (None at reset and
  on a step whose action was not a plain reply, e.g. a tool call);
- `info["first_reply_score"]`: the score of the episode's first reply, OpenClaw-RL's
  "personalisation score" (None until then);
- `info["first_reply_on_topic"]`: whether that reply shares a topic word with its question
  (`personas.on_topic`): a reply that says nothing can still meet a preference;
- `info["user_verdict"]`: "satisfied" | "correction" | "redo" | "gave_up" (None at reset);
- `info["attempt"]`: which try this reply was at its question (1 = first);
- `info["question_index"]`, `info["questions"]`: the question the user is on, and how many;
- `info["persona"]`, `info["split"]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from envs.chat.personas import Persona, on_topic, persona
from envs.chat.tasks import ChatTask, load_tasks
from envs.chat.user import SimulatedUser, UserModel, Verdict
from envs.core import Action, AgentEnv, Message, Reply

SYSTEM_PROMPT = "You are a helpful personal assistant. You are chatting with {name}."


class ChatEnv(AgentEnv):
    """A conversation with a simulated user who holds a hidden preference.

    Args:
        split: "train" or "test" (held out: questions about subjects never trained on).
        persona: one persona key (see `envs.chat.personas.PERSONAS`), or None for all.
        questions_per_episode: questions the user asks before saying goodbye.
        patience: corrections the user makes on one question before giving up on it.
        max_turns: assistant replies allowed; by default every question can use its
            patience, `questions_per_episode * (patience + 1)`.
        reveal_preferences: state the persona's preference in the system prompt (an upper
            bound for evaluation; training keeps it hidden).
        user_model: optional `user_model(messages) -> str`, an LLM that rephrases the
            scripted user's words (decisions stay scripted); see `envs.chat.user`.
    """

    def __init__(
        self,
        split: str = "train",
        persona: str | None = None,
        questions_per_episode: int = 3,
        patience: int = 2,
        max_turns: int | None = None,
        reveal_preferences: bool = False,
        user_model: UserModel | None = None,
    ):
        if patience < 0:
            raise ValueError(f"patience must be at least 0, got {patience}")
        if max_turns is None:
            max_turns = max(2, questions_per_episode * (patience + 1))
        super().__init__(max_turns=max_turns)
        self.split = split
        self.persona_key = persona
        self.tasks = _select(load_tasks(split, questions_per_episode), persona)
        self.patience = patience
        self.reveal_preferences = reveal_preferences
        self.user_model = user_model
        self.task: ChatTask | None = None
        self.persona: Persona | None = None
        self._user: SimulatedUser | None = None
        self._reset_conversation()

    def _reset_conversation(self) -> None:
        self._messages: list[Message] = []
        self._question = 0
        self._attempt = 0
        self._reply_attempt = 0
        self._score: float | None = None
        self._verdict: Verdict | None = None
        self._scored_turn = -1
        self._first_score: float | None = None
        self._first_on_topic: bool | None = None

    # -- hooks -------------------------------------------------------------------------
    def task_ids(self) -> Sequence[str]:
        return list(self.tasks)

    def _load_task(self, task_id: str) -> None:
        self.task = self.tasks[task_id]
        self.persona = persona(self.task.persona)
        self._user = SimulatedUser(self.persona, self.np_random, self.user_model)
        self._reset_conversation()

    @property
    def question(self) -> str | None:
        """The question the user is on: None before a reset and after their last."""
        if self.task is None or self._question >= len(self.task.questions):
            return None
        return self.task.questions[self._question]

    def _first_messages(self) -> list[Message]:
        assert self.task is not None and self.persona is not None and self._user is not None
        system = SYSTEM_PROMPT.format(name=self.persona.name)
        if self.reveal_preferences:
            system += f" {self.persona.name}'s preference: {self.persona.instruction}"
        self._messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": self._user.ask(self.task.questions[0])},
        ]
        return list(self._messages)

    def _on_reply(self, content: str) -> Reply:
        assert self.task is not None and self.persona is not None and self._user is not None
        self._attempt += 1
        self._score = self.persona.score(content)
        self._scored_turn = self._turn
        questions = self.task.questions
        asked = questions[self._question]
        if self._first_score is None:
            self._first_score = self._score
            self._first_on_topic = on_topic(content, asked)
        verdict = self._judge(content, asked)
        if verdict in (Verdict.SATISFIED, Verdict.GAVE_UP):
            self._question += 1
        upcoming = questions[self._question] if self._question < len(questions) else None
        draft = self._user.react(verdict, asked, upcoming, self._attempt)
        self._messages.append({"role": "assistant", "content": content})
        text = self._user.say(verdict, draft, self._messages)
        self._messages.append({"role": "user", "content": text})
        self._verdict, self._reply_attempt = verdict, self._attempt
        if verdict in (Verdict.SATISFIED, Verdict.GAVE_UP):
            self._attempt = 0
        return Reply(({"role": "user", "content": text},), 0.0, terminated=upcoming is None)

    def _judge(self, content: str, question: str) -> Verdict:
        """How the user takes a reply to `question`: the preference met by a reply about
        the question satisfies; met by one about nothing ("Awesome.") draws the question
        again, as a person would, so that a policy cannot please the user by saying
        nothing; missed draws a correction naming the preference."""
        assert self.persona is not None
        met = self.persona.satisfied_by(content)
        if met and (not self.persona.topic_checked or on_topic(content, question)):
            return Verdict.SATISFIED
        if self._attempt > self.patience:
            return Verdict.GAVE_UP
        if met or not content.strip():
            return Verdict.REDO
        return Verdict.CORRECTION

    def _info(self) -> dict[str, Any]:
        scored = self._scored_turn == self._turn
        return {
            "split": self.split,
            "persona": self.persona.key if self.persona else None,
            "questions": len(self.task.questions) if self.task else 0,
            "question_index": self._question,
            "attempt": self._reply_attempt if scored else 0,
            "preference_score": self._score if scored else None,
            "user_verdict": str(self._verdict) if scored else None,
            "first_reply_score": self._first_score,
            "first_reply_on_topic": self._first_on_topic,
        }


def _select(tasks: dict[str, ChatTask], key: str | None) -> dict[str, ChatTask]:
    if key is None:
        return tasks
    persona(key)  # validates the key
    return {task_id: task for task_id, task in tasks.items() if task.persona == key}


class ChatReferenceAgent:
    """Scripted reference: answers every question with its persona's exemplar reply, which
    meets the preference and names the question's topic. It reads the persona and the
    question being asked from the env, as an oracle does."""

    def __init__(self, env: ChatEnv):
        self.env = env

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        assert self.env.persona is not None and self.env.question is not None
        return self.env.persona.exemplar(self.env.question)


CHATTY_REPLY = (
    "Hey there! Great question! There's a lot to say about this, so let me walk you through "
    "it step by step. First, you'll want to understand the basics, because they're the "
    "foundation for everything else. Second, don't rush: it's totally fine to take your time "
    "and experiment with different approaches until something clicks. Third, keep notes on "
    "what works for you and what doesn't, since that's how you'll improve over time. Finally, "
    "remember that everyone learns at their own pace, and that's awesome! I hope this helps, "
    "and feel free to ask me anything else!"
)


class ChattyAgent:
    """A persona-blind agent in the style of a chatty small model: one long, casual, English
    paragraph, which misses every persona's preference."""

    def act(self, observation: list[Message], info: dict[str, Any]) -> Action:
        return CHATTY_REPLY
