"""The body of `POST /v1/chat/completions`, validated as OpenAI's API validates it.

`ChatRequest` refuses what OpenAI's API refuses with a pydantic `ValidationError`, which
the proxy sends as a 400 with OpenAI's error body, its `param` naming the field as OpenAI
does (`messages[1].tool_call_id`, `validation_message`). Types are strict where OpenAI's are:
no "0.5" for a number nor `true` for an integer (an integer is a number). Unknown fields
are accepted and ignored: clients send vendor fields, and the proxy's own session fields
ride in the body (`agents.serving.identity.identify`).

Images: a user, system or tool message may carry `image_url` parts whose URL is a PNG or JPEG
data URL (`agents.vision`); a remote URL is refused (the proxy fetches nothing), and the
proxy checks their size and count (`agents.serving.proxy.ProxyConfig`). A model that takes
no images refuses them at the engine (400).

What this server does not do is refused, not ignored: content parts other than text and
images (audio, files: the chat template would drop them, unseen by the model),
`response_format` other than text, a non-empty `logit_bias`, a non-zero
`frequency_penalty` or `presence_penalty`, audio output.

Tools. `tool_choice` is "none", "auto", "required" or a function of `tools`, and anything
but "none" needs tools. With "none", as without tools, the model is shown no tools and
the reply has no tool calls: engines parse calls from the text only for a request that
offered tools (`agents.toolcalls.assistant_message`), so any markup the model writes is
content. "required" and a named function are accepted but NOT enforced: the policy
samples freely (training needs its own choices, not constrained decoding), so the reply
may call no tool, or another one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
    with_config,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

from agents.vision import SIGNATURES


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


def _refused(message: str) -> PydanticCustomError:
    """A validation error whose message is `message` as it is (a ValueError's would get
    pydantic's "Value error, " before it)."""
    return PydanticCustomError("invalid_value", message)


def _unsupported(what: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"{what} is not supported by this server: {why}")


# -- tools ----------------------------------------------------------------------------------


# typing_extensions' TypedDict: pydantic takes no typing.TypedDict before Python 3.12.
@with_config(ConfigDict(extra="allow"))
class ParametersSchema(TypedDict, total=False):
    """A function's `parameters`: a JSON Schema of an object (checked no further; kept as
    the client wrote it, a plain dict)."""

    type: Literal["object"]
    properties: dict[str, Any]


class FunctionSchema(_Open):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: ParametersSchema | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionSchema


TOOL_CHOICES = ("none", "auto", "required")


def _named_function(choice: Any) -> str | None:
    """The name in `{"type": "function", "function": {"name": ...}}`, else None."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return None


# -- messages -------------------------------------------------------------------------------


class TextPart(_Open):
    """A text content part (an assistant's content takes no other)."""

    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise _unsupported(
                f"content of type {kind!r}", 'it takes text only, {"type": "text", "text": ...}'
            )
        return kind


class ImageURL(_Open):
    url: str
    detail: Literal["auto", "low", "high"] | None = None

    @field_validator("url")
    @classmethod
    def _inline(cls, url: str) -> str:
        if not url.startswith("data:"):
            raise _unsupported(
                "an image by URL",
                "it fetches nothing; send the image inline as a data URL "
                "(data:image/png;base64,...)",
            )
        kind = url[5:].partition(";")[0]
        if kind not in SIGNATURES:
            raise _unsupported(f"an image of type {kind!r}", "send image/png or image/jpeg")
        return url


class Part(_Open):
    """A content part: text, or an image as a data URL. The chat template renders nothing
    else, so an audio or file part would never reach the model."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None

    @field_validator("type")
    @classmethod
    def _known(cls, kind: str) -> str:
        if kind not in ("text", "image_url"):
            raise _unsupported(
                f"content of type {kind!r}",
                'it takes text and images, {"type": "text", "text": ...} or '
                '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}',
            )
        return kind

    @model_validator(mode="after")
    def _complete(self) -> Part:
        if self.type == "text" and self.text is None:
            raise _refused('a text part needs "text"')
        if self.type == "image_url" and self.image_url is None:
            raise _refused('an image part needs "image_url": {"url": ...}')
        return self


Content = str | Annotated[list[Part], Field(min_length=1)]
"""What a system, developer, user or tool message says."""


class CalledFunction(_Open):
    name: str
    arguments: str


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class _Message(_Open):
    role: str
    name: str | None = None

    def for_engine(self) -> dict[str, Any]:
        """The message as the chat template takes it (`developer` is a system message)."""
        message = self.model_dump(exclude_none=True)  # a part keeps only its own fields
        if self.role == "developer":
            message["role"] = "system"
        return message


class _NotAssistant(_Message):
    content: Content
    tool_calls: Any = None

    @field_validator("tool_calls")
    @classmethod
    def _assistant_only(cls, calls: Any) -> Any:
        if calls is not None:
            raise _refused("only assistant messages have tool_calls")
        return calls


class SystemMessage(_NotAssistant):
    role: Literal["system"]


class DeveloperMessage(_NotAssistant):
    role: Literal["developer"]


class UserMessage(_NotAssistant):
    role: Literal["user"]


class ToolMessage(_NotAssistant):
    role: Literal["tool"]
    tool_call_id: str


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


# -- the request ----------------------------------------------------------------------------


class StreamOptions(_Open):
    include_usage: StrictBool = False


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]


Penalty = Annotated[StrictFloat | None, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class ChatRequest(_Open):
    """The body of `POST /v1/chat/completions` (unknown extra fields are ignored).

    Fields are validated in their order here: the validators of `tool_choice` and
    `top_logprobs` read `tools` and `logprobs` from `info.data`.
    """

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Any = None
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: StrictInt = Field(1, ge=1, le=16)
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    return_token_ids: StrictBool = False
    # Accepted at their defaults only (the validators below say why).
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    logit_bias: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        if tools is None:
            return None
        if not tools:  # OpenAI's API refuses it too (its code: empty_array)
            raise _refused("empty array: give at least one tool, or leave tools out")
        names = [t.function.name for t in tools]
        if len(set(names)) < len(names):
            twice = next(n for i, n in enumerate(names) if n in names[:i])
            raise _refused(f"the function name {twice!r} is given twice: names must be unique")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice is None or choice == "none":
            return choice
        named = _named_function(choice)
        if named is None and choice not in TOOL_CHOICES:
            raise _refused(
                'must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}, got ' + repr(choice)
            )
        if "tools" not in info.data:  # the tools were refused: that is the error
            return choice
        tools = info.data["tools"]
        if tools is None:
            raise _refused(f"{choice!r} is only allowed when tools are given")
        if named is not None and named not in {t.function.name for t in tools}:
            raise _refused(f"the function {named!r} is not in tools")
        return choice

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: Any) -> Any:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or not all(stops):
            raise _refused("at most 4 non-empty strings")
        return stop

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and info.data.get("logprobs") is not True:
            raise _refused("needs logprobs: true")
        return top

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, penalty: float | None) -> float | None:
        if penalty:
            raise _unsupported(repr(penalty), "it samples without penalties; use 0")
        return penalty

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, bias: dict[str, Any] | None) -> dict[str, Any] | None:
        if bias:
            raise _unsupported("a logit bias", "it samples without biases; use {} or leave it out")
        return bias

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, form: ResponseFormat | None) -> ResponseFormat | None:
        if form is not None and form.type != "text":
            raise _unsupported(repr(form.type), 'replies are free text; use {"type": "text"}')
        return form

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, modalities: list[str] | None) -> list[str] | None:
        if modalities is not None and modalities != ["text"]:
            raise _unsupported(repr(modalities), 'replies are text only; use ["text"]')
        return modalities

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, audio: dict[str, Any] | None) -> dict[str, Any] | None:
        if audio is not None:
            raise _unsupported("audio output", "replies are text only")
        return audio

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools the model is shown; None for no tools or `tool_choice: "none"`."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


_UNION_FIELDS = frozenset({"content", "stop"})
"""Fields whose errors name the union member that failed, after the field: not a param."""


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """One readable line, and the offending parameter as OpenAI names it
    (`messages[1].content[0].type`), from pydantic's errors.

    The first field's error is taken; of a union's errors (one per member the value
    failed), the one that went deepest, which is the member the client meant.
    """
    field = errors[0]["loc"][:1]
    error = max(
        (e for e in errors if e["loc"][:1] == field),
        key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")),
    )
    param = _param(error["loc"])
    if error["type"].startswith("union_tag"):  # a message's role: missing or unknown
        param += "." + error["ctx"]["discriminator"].strip("'")
    message = error["msg"]
    if error["type"].endswith("_type"):  # a wrong JSON type: say which one came
        message += f", got {_json_type(error.get('input'))}"
    return (f"{param}: {message}" if param else message), (param or None)


def _param(loc: tuple[Any, ...]) -> str:
    param = ""
    for i, key in enumerate(loc):
        if isinstance(key, int):
            param += f"[{key}]"
        elif i and (loc[i - 1] in _UNION_FIELDS or (i == 2 and loc[0] == "messages")):
            continue  # a union member's name, or a message's role (the tag of its model)
        else:
            param += f".{key}" if param else str(key)
    return param


def _json_type(value: Any) -> str:
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


_JSON_TYPES = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
    (type(None), "null"),
)
