"""The personas of `clawgym/Chat-v0`: simulated users, each with one hidden preference.

Every persona wants something a chatty small model does not do by default (short
answers, bullet points, a fixed sign-off, a formal register, Spanish, a TL;DR first) and
has a programmatic check scoring one reply against that preference in [0, 1].

The score is ground truth for EVALUATION ONLY (how personalised are the agent's replies?).
It is never a training reward: the env's reward for a chat turn is always 0, and the
training signal comes from a judge reading the user's next message, as in OpenClaw-RL.
The simulated user uses the check only to decide how to react, as a person would.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

BRIEF_LIMIT = 25
"""Words the brief persona accepts; a reply of 3x as many scores 0."""
SIGN_OFF = "Cheers, Claw"
TLDR_LIMIT = 15
"""Words the TL;DR line may hold after its marker."""


@dataclass(frozen=True)
class Persona:
    """A simulated user and the preference they hold.

    Attributes:
        key: the persona's id, as `ChatEnv(persona=...)` takes it.
        name: how the user is called in the system prompt.
        preference: what they want, in the third person (docs, LLM-simulated users).
        instruction: the same as an instruction to the assistant (`reveal_preferences`).
        complaints: what they say when a reply misses it; each names the preference.
        check: the ground-truth preference score of one reply, in [0, 1].
        exemplar: a reply to a question meeting the preference and naming the question's
            topic, for the scripted reference agent.
        threshold: the score from which the user is satisfied.
        topic_checked: the user also wants the reply to be about their question
            (`on_topic`); off for a persona who wants a language `on_topic` cannot read.
    """

    key: str
    name: str
    preference: str
    instruction: str
    complaints: tuple[str, ...]
    check: Callable[[str], float]
    exemplar: Callable[[str], str]
    threshold: float = 1.0
    topic_checked: bool = True

    def score(self, reply: str) -> float:
        """The preference score of one reply: 0 for an empty one, else the check's."""
        return float(self.check(reply)) if reply.strip() else 0.0

    def satisfied_by(self, reply: str) -> bool:
        """Whether the user accepts this reply and moves on."""
        return self.score(reply) >= self.threshold


# -- checks ----------------------------------------------------------------------------
def brevity(text: str) -> float:
    """1 up to BRIEF_LIMIT words, falling linearly to 0 at three times the limit."""
    words = len(text.split())
    if words <= BRIEF_LIMIT:
        return 1.0
    return max(0.0, 1.0 - (words - BRIEF_LIMIT) / (2 * BRIEF_LIMIT))


_BULLET = re.compile(r"^[-*\u2022]\s+\S")


def bullet_points(text: str) -> float:
    """The share of non-empty lines that are `- ` / `* ` bullets; 0 with fewer than two."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    bullets = sum(bool(_BULLET.match(line)) for line in lines)
    return bullets / len(lines) if bullets >= 2 else 0.0


def _letters(text: str) -> str:
    return " ".join(re.findall(r"[a-z]+", text.lower()))


def sign_off(text: str) -> float:
    """1 when the last line ends with SIGN_OFF after some answer, 0.5 when it is elsewhere."""
    lines = [line for line in text.splitlines() if line.strip()]
    mark = _letters(SIGN_OFF)
    body_words = len(_letters(text).split()) - len(mark.split())
    if body_words < 3 or mark not in _letters(text):
        return 0.0
    return 1.0 if _letters(lines[-1]).endswith(mark) else 0.5


_CONTRACTION = re.compile(
    r"\b(?:[a-z]+n['\u2019]t|(?:i|you|we|they|he|she|it|that|there|here|what|who|let)"
    r"['\u2019](?:s|m|re|ve|ll|d))\b",
    re.IGNORECASE,
)
_CASUAL = frozenset(
    "hey hiya awesome cool gonna wanna gotta yeah yep nope lol btw stuff kinda sorta "
    "super folks guys totally ok okay".split()
)


def _is_emoji(char: str) -> bool:
    code = ord(char)
    return 0x1F300 <= code <= 0x1FAFF or 0x2600 <= code <= 0x27BF


def formal_register(text: str) -> float:
    """1 minus a third per informality: '!', contraction, slang word or emoji."""
    casual = sum(word in _CASUAL for word in re.findall(r"[a-z]+", text.lower()))
    violations = (
        text.count("!") + len(_CONTRACTION.findall(text)) + casual + sum(_is_emoji(c) for c in text)
    )
    return max(0.0, 1.0 - violations / 3)


_SPANISH_WORDS = set(
    "el la los las un una unos unas de del y que en es por para con su sus lo como más "
    "pero se al le muy sin sobre también este esta esto estos estas puedes tu tus hay "
    "está están cuando porque ni sí ya todo toda bien cada donde mejor puede pueden "
    "hacer tiene tienen ser usar agua día días mucho poco antes después entre".split()
)
_ENGLISH_WORDS = set(
    "the and of to is in it that for you with on as are be this your or an can if but "
    "not by from at have they we will what so do more there their which about would "
    "when was how also just like some these them then its my our here".split()
)
_SHARED = _SPANISH_WORDS & _ENGLISH_WORDS


def spanish(text: str) -> float:
    """The share of Spanish among the common words of either language in the reply."""
    words = re.findall(r"[^\W\d_]+", text.lower())
    es = sum(w in _SPANISH_WORDS and w not in _SHARED for w in words)
    en = sum(w in _ENGLISH_WORDS and w not in _SHARED for w in words)
    return es / (es + en) if es + en else 0.0


_TLDR = re.compile(r"^[*_#>\s]*tl\s*;?\s*dr[*_\s]*[:.\-\u2013\u2014]?[*_\s]*(.*)$", re.IGNORECASE)


def tldr_first(text: str) -> float:
    """1 when the first line is `TL;DR: <= TLDR_LIMIT words`; 0.5 when a TL;DR is elsewhere
    or too long; else 0."""
    first = next(line for line in text.splitlines() if line.strip())
    match = _TLDR.match(first)
    if match and 1 <= len(match.group(1).split()) <= TLDR_LIMIT:
        return 1.0
    return 0.5 if match or re.search(r"tl\s*;?\s*dr", text, re.IGNORECASE) else 0.0


# -- the personas ----------------------------------------------------------------------
_FILLER = frozenset(
    "about after again also answer could does from give have hello help here just know like "
    "make many more most much need other please recommend should some suggest tell than that "
    "their them then there these they thing things this tips want what when where which while "
    "with would your advice explain"
    # the question templates' own words (questions.json): no question is about them
    " work keep hearing plain terms best difference between compare".split()
)


def topic_words(text: str) -> set[str]:
    """English words of four or more letters that carry a topic, cut to five letters (a
    crude stem: "passwords" and "password" meet)."""
    return {w[:5] for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4} - {
        w[:5] for w in _FILLER
    }


def on_topic(reply: str, question: str) -> bool:
    """Whether a reply shares a topic word with the question it answers (any reply does,
    where the question has none to share: "What is GPS?"). No persona's check looks at
    content, so a reply that says nothing can meet a preference: a small policy trained
    toward brevity learned to echo its system prompt, and SmolLM2 trained on `brief` learned
    to say "Awesome." to every question. The simulated user asks again on such a reply, and
    evaluation reports it beside the preference score. English only (a Spanish reply shares
    no English word)."""
    wanted = topic_words(question)
    return not wanted or bool(topic_words(reply) & wanted)


def topic(question: str, most: int = 2) -> str:
    """The `most` longest words of a question that carry its topic (`topic_words`), whole
    and in the question's order ("How does the immune system work?": "immune system"):
    what an exemplar reply names to be about the question."""
    words = [w for w in dict.fromkeys(re.findall(r"[a-z]+", question.lower())) if topic_words(w)]
    longest = set(sorted(words, key=len, reverse=True)[:most])
    return " ".join(w for w in words if w in longest) or "this"


_GIST = "start with the basics, keep it simple, and adjust as you go"

PERSONAS: dict[str, Persona] = {
    p.key: p
    for p in (
        Persona(
            key="brief",
            name="Sam",
            preference=f"want short answers of at most {BRIEF_LIMIT} words, no padding",
            instruction=f"Answer in at most {BRIEF_LIMIT} words.",
            complaints=(
                f"Too long. Just give me the answer, {BRIEF_LIMIT} words max.",
                f"That's way more than I need. Keep it under {BRIEF_LIMIT} words.",
                f"Too long, I don't have time to read all that. No more than {BRIEF_LIMIT} "
                "words, please.",
                f"Shorter, please. A sentence or two, under {BRIEF_LIMIT} words.",
            ),
            check=brevity,
            exemplar=lambda q: f"On {topic(q)}: {_GIST}.",
        ),
        Persona(
            key="bullets",
            name="Priya",
            preference="want every answer as a list of short bullet points, no paragraphs",
            instruction="Answer only with bullet points, one per line, each starting with '- '.",
            complaints=(
                "Please put it in bullet points. I can't read paragraphs.",
                "Bullet points only, please: one short point per line starting with '- '.",
                "Not as a paragraph, please. Format it as a bulleted list, no intro.",
            ),
            check=bullet_points,
            exemplar=lambda q: (
                f"- {topic(q).capitalize()}: start with the basics.\n- Keep it simple.\n"
                "- Adjust as you go."
            ),
        ),
        Persona(
            key="signoff",
            name="Morgan",
            preference=f"want every reply to end with the line '{SIGN_OFF}'",
            instruction=f"End every reply with the line '{SIGN_OFF}'.",
            complaints=(
                f"You forgot the sign-off. Always end with '{SIGN_OFF}' on the last line.",
                f"Where's the sign-off? Please finish every reply with '{SIGN_OFF}'.",
                f"Not quite: end your replies with '{SIGN_OFF}', like we agreed.",
            ),
            check=sign_off,
            exemplar=lambda q: f"On {topic(q)}: {_GIST}.\n\n{SIGN_OFF}",
        ),
        Persona(
            key="formal",
            name="Dr. Novak",
            preference="want a formal register: no exclamation marks, contractions, slang or emoji",
            instruction="Write formally: no exclamation marks, contractions, slang or emoji.",
            complaints=(
                "Please keep it formal: no exclamation marks, no contractions, no slang.",
                "That is too casual for me. Write formally, without exclamation marks or "
                "contractions such as 'don't'.",
                "A more professional tone, please. No exclamation marks, no emoji, "
                "no 'you'll' or 'it's'.",
            ),
            check=formal_register,
            exemplar=lambda q: (
                f"Certainly. Regarding {topic(q)}, the recommended approach is to begin with "
                "the fundamentals, proceed in small steps, and adjust as necessary."
            ),
        ),
        Persona(
            key="spanish",
            name="Lucía",
            preference="are practising Spanish and want every answer written in Spanish",
            instruction="Answer in Spanish only.",
            complaints=(
                "In Spanish, please. I only want answers in Spanish.",
                "¿En español, por favor? Answer me in Spanish, not English.",
                "I'm practising my Spanish, so please reply in Spanish only.",
            ),
            check=spanish,
            exemplar=lambda q: (
                "Claro. La respuesta corta es que conviene empezar por lo básico, "
                "ir paso a paso y ajustar según tu situación."
            ),
            threshold=0.9,
            topic_checked=False,
        ),
        Persona(
            key="tldr",
            name="Kai",
            preference=f"want the bottom line first: a first line 'TL;DR:' of at most "
            f"{TLDR_LIMIT} words, details after",
            instruction=f"Begin with one line 'TL;DR: ' summing up the answer in at most "
            f"{TLDR_LIMIT} words; details may follow.",
            complaints=(
                "Start with a one-line TL;DR, please. Begin your reply with 'TL;DR:' and the "
                "answer.",
                "Where's my TL;DR? The first line should be 'TL;DR:' plus a short summary.",
                f"Bottom line first, please: open with 'TL;DR:' in one line of at most "
                f"{TLDR_LIMIT} words.",
            ),
            check=tldr_first,
            exemplar=lambda q: (
                f"TL;DR: on {topic(q)}, start simple and adjust as you go.\n\n"
                "The details depend on your situation."
            ),
        ),
    )
}


def persona(key: str) -> Persona:
    """The persona of a key; raises ValueError naming the known ones."""
    if key not in PERSONAS:
        raise ValueError(f"unknown persona {key!r}; choose one of {sorted(PERSONAS)}")
    return PERSONAS[key]
