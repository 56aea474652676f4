"""The protobuf wire format against the SDK's own encoders and decoders."""

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from skyrl_tinker.wire import WireError, decode_forward_backward, encode_forward_backward_output, encode_sample_response


def test_a_forward_backward_request_from_the_sdk_decodes_exactly():
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [-1.5, -0.25, -3.0], "advantages": [0.0, 1.0, -2.0]},
        ),
        types.Datum(model_input=types.ModelInput.from_ints([9]), loss_fn_inputs={"target_tokens": [10]}),
    ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}),
        model_id="s:train:0",
        seq_id=3,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = True
    for encoding, body in (("", msg.SerializeToString()), ("zstd", __import__("zstandard").ZstdCompressor().compress(msg.SerializeToString()))):
        call = decode_forward_backward(body, encoding)
        assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("s:train:0", 3, "ppo", True)
        assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
        assert call.data[0].tokens.tolist() == [5, 6, 7] and call.data[1].tokens.tolist() == [9]
        assert call.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
        assert call.data[0].inputs["logprobs"].tolist() == [-1.5, -0.25, -3.0]
        assert call.data[0].inputs["advantages"].dtype == np.float32


def test_garbage_and_unknown_encodings_are_refused():
    with pytest.raises(WireError, match="not a ForwardBackwardRequest"):
        decode_forward_backward(b"\xff\xff\xff\xff", None)
    with pytest.raises(WireError, match="Content-Encoding 'gzip'"):
        decode_forward_backward(b"", "gzip")


def test_a_tensor_whose_shape_or_bytes_do_not_fit_its_values_is_refused_naming_the_field():
    from tinker.proto import tinker_public_pb2 as pb

    def body(shape: list[int], raw: bytes) -> bytes:
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=[types.Datum(model_input=types.ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, 7]})],
                loss_fn="cross_entropy"),
            model_id="s:train:0", seq_id=1)
        msg = forward_backward_request_to_proto(request)
        tensor = msg.data[0].loss_fn_inputs["target_tokens"]
        tensor.dtype, tensor.dense = pb.DTYPE_INT64, raw
        del tensor.shape[:]
        tensor.shape.extend(shape)
        return msg.SerializeToString()

    two = np.array([6, 7], dtype=np.int64).tobytes()
    assert decode_forward_backward(body([2], two), None).data[0].inputs["target_tokens"].tolist() == [6, 7]
    assert decode_forward_backward(body([1, 2], two), None).data[0].inputs["target_tokens"].tolist() == [6, 7]
    with pytest.raises(WireError, match=r"data\[0\]\.loss_fn_inputs\.target_tokens: shape \[3\] does not hold 2 values"):
        decode_forward_backward(body([3], two), None)
    with pytest.raises(WireError, match=r"target_tokens: 12 bytes is not a whole number of int64 values"):
        decode_forward_backward(body([2], two[:12]), None)


def test_outputs_decode_in_the_sdk_bit_for_bit():
    logprobs = [np.array([-1.0, -2.5, 1e-8], dtype=np.float32), np.array([-0.125], dtype=np.float32)]
    out = deserialize_forward_backward_output(encode_forward_backward_output(logprobs, {"loss:sum": 4.5}))
    assert out.metrics == {"loss:sum": 4.5}
    for sent, got in zip(logprobs, out.loss_fn_outputs):
        assert np.asarray(got["logprobs"].data, dtype=np.float32).view(np.int32).tolist() == sent.view(np.int32).tolist()
    sample = deserialize_sample_response(
        encode_sample_response([("stop", [3, 4], [-0.5, -1.25]), ("length", [7], [-2.0])], np.array([np.nan, -1.0], dtype=np.float32))
    )
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.sequences[0].tokens == [3, 4] and sample.sequences[0].logprobs == [-0.5, -1.25]
    assert np.isnan(sample.prompt_logprobs_np[0]) and sample.prompt_logprobs_np[1] == -1.0

