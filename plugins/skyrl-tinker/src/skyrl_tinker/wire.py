"""The protobuf half of the Tinker wire format (SDK 0.38): ``forward_backward`` requests arrive as
``application/x-protobuf`` (optionally zstd), and the results of ``forward_backward`` and
``asample`` are returned as protobuf when the SDK asks for it (``Accept: application/x-protobuf``,
which it always does for those two result types). The message schema is the SDK's own published
``tinker.proto.tinker_public_pb2``; everything else on the wire is JSON.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import attrs
import numpy as np

from tinker.proto import tinker_public_pb2 as pb

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A body that is not a valid request (names the field)."""


@attrs.frozen
class WireDatum:
    tokens: np.ndarray  # int64 [T]
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, flattened


@attrs.frozen
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, Any]
    data: list[WireDatum]
    forward_only: bool


def _tensor(msg: Any, where: str) -> np.ndarray:
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"{where}: unsupported tensor dtype {msg.dtype}")
    if msg.HasField("sparse_csr"):
        raise WireError(f"{where}: sparse tensors are not supported by this server")
    raw = msg.dense
    if len(raw) % np.dtype(dtype).itemsize:
        raise WireError(f"{where}: {len(raw)} bytes is not a whole number of {np.dtype(dtype).name} values")
    array = np.frombuffer(raw, dtype=dtype).copy()
    shape = list(msg.shape)
    if shape and math.prod(shape) != array.size:  # (math.prod: np.prod was a third of decoding a batch)
        raise WireError(f"{where}: shape {shape} does not hold {array.size} values")
    return array.reshape(-1)


def decode_forward_backward(body: bytes, content_encoding: str | None) -> ForwardBackwardCall:
    if content_encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body)
    elif content_encoding not in (None, "", "identity"):
        raise WireError(f"Content-Encoding {content_encoding!r} is not supported (zstd or none)")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError
        raise WireError(f"body: not a ForwardBackwardRequest protobuf ({error})") from None
    if not msg.model_id:
        raise WireError("model_id: missing")
    config: dict[str, Any] = {}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    for key, value in msg.loss_fn_config.items():
        config.setdefault(key, value)
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind not in (None, "encoded_text"):
                raise WireError(f"data[{i}].model_input[{j}]: {kind} chunks are not supported (text tokens only)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}") for name, t in datum.loss_fn_inputs.items()}
        data.append(WireDatum(np.asarray(tokens, dtype=np.int64), inputs))
    return ForwardBackwardCall(msg.model_id, int(msg.seq_id), msg.loss_fn, config, data, bool(msg.forward_only))


def _batched(arrays: Sequence[np.ndarray], dtype: Any, code: int) -> Any:
    parts = [np.ascontiguousarray(a, dtype=dtype) for a in arrays]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([p.nbytes for p in parts])
    data = b"".join(p.tobytes() for p in parts)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=code)


def encode_forward_backward_output(logprobs: Sequence[np.ndarray], metrics: dict[str, float]) -> bytes:
    """One ``ArrayRecord`` whose field ``logprobs`` holds each datum's float32 logprobs."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(logprobs)
    record.fields["logprobs"].CopyFrom(_batched(logprobs, np.float32, pb.DTYPE_FLOAT32))
    return msg.SerializeToString()


def encode_sample_response(
    sequences: Sequence[tuple[str, Sequence[int], Sequence[float]]], prompt_logprobs: np.ndarray | None
) -> bytes:
    """``sequences``: (stop reason "stop" | "length", token ids, logprobs). ``prompt_logprobs``:
    ``[len(prompt)]`` float32 with NaN at position 0, or None when not asked for."""
    msg = pb.SampleResponse()
    for stop_reason, tokens, logprobs in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if stop_reason == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
