"""Tinker's binary wire format: protobuf forward_backward requests in, protobuf
ForwardBackwardOutput and SampleResponse out.

The messages are the SDK's own (`tinker.proto.tinker_public_pb2`), so the server reads and
writes exactly what the SDK writes and reads; everything else on the wire is JSON.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from trainers.tinker.errors import UserError

_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}


@dataclass(frozen=True)
class Datum:
    """One training example: the model's input tokens and the loss's per-token inputs."""

    tokens: tuple[int, ...]
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class ForwardBackwardCall:
    """A decoded forward_backward request."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    data: tuple[Datum, ...]
    forward_only: bool


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """Parses the SDK's protobuf body.

    Raises:
        UserError: not a ForwardBackwardRequest, or a datum this server cannot read.
    """
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # protobuf raises its own DecodeError
        raise UserError(f"malformed forward_backward body: {error}") from error
    config: dict[str, float | str] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = tuple(_datum(d, i) for i, d in enumerate(message.data))
    return ForwardBackwardCall(
        message.model_id, message.seq_id, message.loss_fn, config, data, message.forward_only
    )


def _datum(message: pb.Datum, index: int) -> Datum:
    tokens: list[int] = []
    for chunk in message.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise UserError(f"datum {index}: only encoded_text chunks are served")
        tokens.extend(int(t) for t in np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    inputs = {
        name: _tensor(t, f"datum {index} {name}") for name, t in message.loss_fn_inputs.items()
    }
    return Datum(tuple(tokens), inputs)


def _tensor(message: pb.Tensor, where: str) -> np.ndarray:
    dtype = _NUMPY.get(message.dtype)
    if dtype is None:
        raise UserError(f"{where}: unsupported dtype {message.dtype}")
    if message.WhichOneof("encoding") != "dense":
        raise UserError(f"{where}: only dense tensors are served")
    array = np.frombuffer(message.dense, dtype=dtype)
    shape = tuple(message.shape) or (array.size,)
    if math.prod(shape) != array.size:
        raise UserError(f"{where}: shape {list(shape)} does not hold {array.size} values")
    return array.reshape(shape)


def encode_forward_backward(
    outputs: Sequence[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """One ArrayRecord with every datum's outputs (1-D float32 each), plus the metrics."""
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    message.metrics.update(metrics)
    record = message.loss_fn_outputs.add(num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [np.asarray(o[name], dtype=np.float32).ravel() for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        field = record.fields[name]
        field.dtype = pb.DTYPE_FLOAT32
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
    return message.SerializeToString()


@dataclass(frozen=True)
class Sampled:
    """One sampled sequence."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stopped: bool
    """True: a stop token or string ended it; False: max_tokens did."""


def encode_sample(sequences: Sequence[Sampled], prompt_logprobs: Sequence[float] | None) -> bytes:
    """A SampleResponse; a prompt log-prob of NaN reads as None in the SDK (position 0)."""
    message = pb.SampleResponse()
    for sequence in sequences:
        message.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if sequence.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sequence.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(sequence.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        message.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return message.SerializeToString()
