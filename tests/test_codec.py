"""Codec: every dtype and layout round-trips bit-exactly; errors name the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmclient.codec import Decoder, Encoder
from shmclient.errors import SerializationError
from shmclient.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityOutput,
    UtilityRequest,
)


def _cpu_dtypes() -> list[torch.dtype]:
    """Every torch dtype that can hold a plain (non-quantized) CPU tensor."""
    seen: dict[torch.dtype, None] = {}
    for name in dir(torch):
        dt = getattr(torch, name)
        if not isinstance(dt, torch.dtype) or dt in seen:
            continue
        try:
            t = torch.zeros(4 * dt.itemsize, dtype=torch.uint8).view(dt)
        except (RuntimeError, TypeError):
            continue
        if t.is_quantized or name.startswith("q"):
            continue
        seen[dt] = None
    return list(seen)


CPU_DTYPES = _cpu_dtypes()


def random_tensor(shape, dtype, seed=0) -> torch.Tensor:
    """Random raw bytes viewed as ``dtype`` (bools stay 0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype is torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def raw(t) -> bytes:
    """The values' bytes in C order (bit-exact comparison, NaNs included)."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).tobytes()
    if not t.numel():
        return b""
    flat = torch.empty(t.shape, dtype=t.dtype)
    flat.view(_same_size_int(t.dtype)).copy_(t.view(_same_size_int(t.dtype)))
    return flat.reshape(-1).view(torch.uint8).numpy().tobytes()


def _same_size_int(dtype):
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}[
        dtype.itemsize
    ]


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    assert a.dtype == b.dtype
    assert tuple(a.shape) == tuple(b.shape)
    assert raw(a) == raw(b)


@pytest.fixture(params=["inline", "frames"])
def roundtrip(request):
    """Encode + decode through one of the two in-process transports."""
    if request.param == "inline":
        enc, dec = Encoder(), Decoder()
        return lambda obj: dec.decode(enc.encode(obj))
    enc, dec = Encoder(inline_threshold=64), Decoder()
    return lambda obj: dec.decode_frames(enc.encode_frames(obj))


def test_dtype_list_is_complete():
    names = {str(d) for d in CPU_DTYPES}
    for must in ("bfloat16", "bool", "complex64", "complex128", "float16", "int8", "uint8",
                 "float8_e4m3fn", "uint64"):
        assert f"torch.{must}" in names


def test_every_torch_dtype_roundtrips(roundtrip):
    # One test over all dtypes (not one per dtype): each test pays a leak-check teardown.
    failures = []
    for dtype in CPU_DTYPES:
        for shape in [(), (0,), (3, 0, 2), (7,), (5, 33), (1,)]:
            t = random_tensor(shape, dtype)
            for x in (t, t[..., ::2] if t.dim() else t):
                try:
                    assert_same(roundtrip(x), x)
                except Exception as e:  # collect all, report together
                    failures.append(f"{dtype} {tuple(x.shape)} {x.stride()}: {e!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.bool])
def test_non_contiguous_tensors(roundtrip, dtype):
    base = random_tensor((8, 10, 6), dtype)
    for t in (base[:, ::3], base.transpose(0, 2), base[2:5, 1, ::2], base[:, :1].expand(8, 4, 6)):
        assert not t.is_contiguous()
        out = roundtrip(t)
        assert out.is_contiguous()
        assert_same(out, t)


def test_conjugate_and_negative_views_are_resolved(roundtrip):
    z = torch.randn(6, dtype=torch.complex64)
    assert torch.equal(roundtrip(z.conj()), z.conj().resolve_conj())
    neg = z.conj().imag  # a negative-bit view
    assert torch.equal(roundtrip(neg), neg.resolve_neg())


@pytest.mark.parametrize(
    "dtype", ["<f4", ">f8", "<i2", "u1", "?", "<c16", "<f2", "<M8[ns]", "<m8[s]", "<U5", "S3"]
)
def test_numpy_arrays(roundtrip, dtype):
    a = np.frombuffer(np.random.default_rng(0).bytes(48 * np.dtype(dtype).itemsize), dtype)
    if np.dtype(dtype).kind == "b":
        a = a.view(np.uint8) % 2 == 1
    a = a.reshape(6, 8)
    for x in (a, a[:, ::2], a[:0], a[2, 3:4].reshape(())):
        out = roundtrip(x)
        assert_same(out, x)
        assert out.dtype.str == x.dtype.str  # byte order kept


def test_fortran_order_is_kept(roundtrip):
    a = np.asfortranarray(np.arange(60, dtype=np.float64).reshape(3, 4, 5))
    out = roundtrip(a)
    assert out.flags.f_contiguous and not out.flags.c_contiguous
    assert_same(out, a)


def test_numpy_scalars_come_back_as_scalars(roundtrip):
    for v in (np.float32(1.5), np.int64(-3), np.bool_(True), np.complex128(1 - 2j)):
        out = roundtrip(v)
        assert type(out) is type(v) and out == v


def test_nested_in_containers(roundtrip):
    t, a = torch.randn(4, 4), np.arange(5)
    out = roundtrip({"x": [t, (a, [t[0]])], "n": None, "s": "str"})
    assert_same(out["x"][0], t)
    assert_same(out["x"][1][0], a)
    assert_same(out["x"][1][1][0], t[0])
    assert out["n"] is None and out["s"] == "str"


def test_message_structs_carry_tensors():
    enc = Encoder()
    emb = torch.randn(17, 64, dtype=torch.bfloat16)
    req = EngineCoreRequest(request_id="r1", prompt_embeds=emb)
    got = Decoder(EngineCoreRequest).decode(enc.encode(req))
    assert got.request_id == "r1"
    assert_same(got.prompt_embeds, emb)

    pooled = torch.randn(1024)
    outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput(request_id="a", pooling_output=pooled), EngineCoreOutput(request_id="b")],
        utility_output=UtilityOutput(call_id=7, result=(torch.ones(3), [np.zeros(2)])),
    )
    got = Decoder(EngineCoreOutputs).decode(enc.encode(outs))
    assert_same(got.outputs[0].pooling_output, pooled)
    assert got.outputs[1].pooling_output is None
    assert_same(got.utility_output.result[0], torch.ones(3))
    assert_same(got.utility_output.result[1][0], np.zeros(2))

    call = UtilityRequest(0, 1, "echo", (torch.arange(6).reshape(2, 3), "x"))
    got = Decoder(UtilityRequest).decode(enc.encode(call))
    assert_same(got.args[0], call.args[0])


def test_inline_copies_out_of_the_message_buffer():
    t = torch.randn(100)
    buf = bytearray(Encoder().encode(t))
    out = Decoder().decode(memoryview(buf))
    buf[:] = bytes(len(buf))  # the transport reuses its buffer
    assert_same(out, t)
    out += 1  # and the result is writable


def test_frames_split_by_size():
    enc = Encoder(inline_threshold=256)
    small, big = torch.randn(8), torch.randn(64)  # 32 and 256 bytes
    frames = enc.encode_frames([small, big])
    assert len(frames) == 2 and bytes(frames[1]) == raw(big)
    frames = enc.encode_frames([small, small])
    assert len(frames) == 1
    assert len(Encoder().encode(big)) > 256  # no transport: inline


def test_frames_are_zero_copy_both_ways():
    t = torch.randn(1000)
    frames = Encoder().encode_frames(t)
    out = Decoder().decode_frames([frames[0], bytearray(frames[1])])
    assert_same(out, t)
    assert out.data_ptr() != t.data_ptr()
    shared = bytearray(frames[1])
    out = Decoder().decode_frames([frames[0], shared])
    shared[:4] = b"\0\0\0\0"
    assert out[0].item() == 0.0  # the tensor views the frame


def test_encode_into_caller_buffer():
    enc, dec = Encoder(), Decoder()
    buf = bytearray(b"hdr:")
    enc.encode_into([torch.arange(3)], buf, 4)
    assert buf[:4] == b"hdr:"
    assert_same(dec.decode(memoryview(buf)[4:])[0], torch.arange(3))


@pytest.mark.parametrize(
    "value, words",
    [
        (torch.randn(3, requires_grad=True), "requires_grad"),
        (torch.randn(3, requires_grad=True) * 2, "requires_grad"),
        (torch.randn(4, 4).to_sparse(), "sparse"),
        (torch.randn(4, 4).to_sparse_csr(), "sparse"),
        (torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "quantized"),
        (torch.empty(3, device="meta"), "meta"),
        (torch.zeros(8, dtype=torch.uint8).view(torch.qint8), "quantized"),
        (torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "nested"),
        (np.array([object()], dtype=object), "object"),
        (np.zeros(2, dtype=[("a", "<i4")]), "structured"),
        (object(), "builtins.object"),
        (complex, "type"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v,
)
def test_unsupported_values_raise(value, words):
    for encode in (Encoder().encode, Encoder().encode_frames):
        with pytest.raises(SerializationError, match=words):
            encode({"x": [1, value]})


def test_parameter_without_grad_is_sent_as_tensor():
    p = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    out = Decoder().decode(Encoder().encode(p))
    assert type(out) is torch.Tensor and torch.equal(out, p.data)


def test_out_of_band_handle_without_receiver_fails_clearly():
    class Sender:
        def put(self, src, nbytes, placed):
            placed.append([0, 1, 2])
            return placed[-1]

        def put_cuda(self, t):  # pragma: no cover
            return None

        def cancel(self, h):  # pragma: no cover
            pass

    msg = Encoder(Sender()).encode(torch.randn(100))
    with pytest.raises(SerializationError, match="no tensor receiver"):
        Decoder().decode(msg)


def test_failed_encode_frees_what_it_placed():
    placed, cancelled = [], []

    class Sender:
        def put(self, src, nbytes, listed):  # (the encoder's list of the message's handles)
            placed.append([len(placed)])
            listed.append(placed[-1])
            return placed[-1]

        def put_cuda(self, t):  # pragma: no cover
            return None

        def cancel(self, h):
            cancelled.append(h)

    enc = Encoder(Sender())
    with pytest.raises(SerializationError):
        enc.encode([torch.randn(100), np.zeros(100), object()])
    assert cancelled == placed and len(placed) == 2
    enc.encode([torch.randn(100)])
    assert len(cancelled) == 2


def test_declined_put_goes_inline():
    class Full:
        def put(self, src, nbytes, placed):
            return None

        def put_cuda(self, t):  # pragma: no cover
            return None

        def cancel(self, h):  # pragma: no cover
            pass

    t = torch.randn(1000)
    assert_same(Decoder().decode(Encoder(Full()).encode(t)), t)


def test_unknown_extension_code_rejected():
    import msgspec

    with pytest.raises(SerializationError, match="extension type 9"):
        Decoder().decode(msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b"\0\0")))


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=4),
    dtype=st.sampled_from(CPU_DTYPES),
    step=st.integers(1, 3),
    frames=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes_and_dtypes(shape, dtype, step, frames, seed):
    t = random_tensor(shape, dtype, seed)
    if t.dim():
        t = t[..., ::step]
    enc, dec = Encoder(inline_threshold=32), Decoder()
    out = dec.decode_frames(enc.encode_frames(t)) if frames else dec.decode(enc.encode(t))
    assert_same(out, t)


def test_dtypes_a_peer_can_name_without_end_are_not_kept():
    """Each string length or datetime unit is a dtype of its own: every one a peer named
    was cached for good (2,000,000 empty arrays of distinct lengths: +443 MiB)."""
    from shmclient import dtypes

    dec = Decoder()
    for n in range(1, 200):
        assert dec.decode(Encoder().encode(np.zeros(0, f"S{n}"))).dtype == np.dtype(f"S{n}")
        dec.decode(Encoder().encode(np.zeros(0, f"<U{n}")))
    dec.decode(Encoder().encode(np.zeros(2, "<M8[ms]")))
    assert dec.decode(Encoder().encode(np.zeros(2, "<f4"))).dtype == np.float32
    assert not [k for k in dtypes._numpy_cache if k[1] in "SUMm"]
    assert "<f4" in dtypes._numpy_cache
