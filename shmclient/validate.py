"""Checks at the door: types and ranges of every field a client sends, before it travels.

Lowest layer beside ``messages``: imports ``messages`` and ``errors`` only (torch is looked
up in ``sys.modules``, never imported: a tensor can only exist if torch is loaded). The
same functions guard the engine (``shmclient_engine.request.check_request`` calls
``check_request``), so a request either client refuses is one the engine would refuse,
with the same words. Every failure is an ``InvalidRequestError`` (a ``ValueError``)
naming the request and the field. Nothing here blocks or changes its argument. Its
contract (the rules per field, what "int" means, the cost): docs/design.md, "Module
notes", ``shmclient.validate``.
"""

from __future__ import annotations

import math
import sys
from typing import Annotated, Any

import msgspec

from .errors import InvalidRequestError
from .messages import EngineCoreRequest, LoRARequest, PoolingParams, SamplingParams

__all__ = [
    "POOLING_TASKS",
    "check_abort_ids",
    "check_request",
    "check_timeout",
    "check_utility_call",
]

#: Pooling tasks the engine serves (``PoolingParams.task``).
POOLING_TASKS = ("embed",)

_I64_MIN = -(2**63)
_I64_END = 2**63
_U64_END = 2**64
_FMAX = sys.float_info.max
#: One C pass over a list for "every item a non-bool int in range" (msgspec.convert is
#: strict: bools, floats and numpy integers are refused). Keyed by the range's end.
_ID_LISTS: dict[int, Any] = {}
_I64_LIST = list[Annotated[int, msgspec.Meta(ge=_I64_MIN, le=_I64_END - 1)]]


def _id_list(end: int) -> Any:
    t = _ID_LISTS.get(end)
    if t is None:
        t = _ID_LISTS[end] = list[Annotated[int, msgspec.Meta(ge=0, le=end - 1)]]
    return t


def _bad(rid: Any, field: str, value: Any, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"request {rid!r}: {field}={_short(value)} is invalid: {why}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(x: Any, low: int, end: int) -> bool:
    return type(x) is int and low <= x < end


def _is_number(x: Any, low: float, high: float) -> bool:
    """A non-bool int or a float, finite, in [low, high]."""
    t = type(x)
    if t is float:
        return low <= x <= high  # NaN fails both comparisons; inf fails high <= _FMAX
    return t is int and low <= x <= high and _I64_MIN <= x < _I64_END


def check_request(
    request: Any,
    *,
    max_model_len: int,
    hidden_size: int | None,
    vocab_size: int | None,
    pooling_tasks: tuple[str, ...] = POOLING_TASKS,
) -> None:
    """Raise ``InvalidRequestError`` naming the field unless ``request`` is a well-formed
    ``EngineCoreRequest`` this engine can serve. ``hidden_size`` / ``vocab_size`` None
    skip the width and vocabulary checks. Never blocks; changes nothing."""
    if type(request) is not EngineCoreRequest and not isinstance(request, EngineCoreRequest):
        raise InvalidRequestError(
            f"add_request() takes an EngineCoreRequest, got {type(request).__name__}"
        )
    r = request
    rid = r.request_id
    if type(rid) is not str or not rid:
        raise InvalidRequestError(f"request_id must be a non-empty str, got {_short(rid)}")

    ids = r.prompt_token_ids
    embeds = r.prompt_embeds
    if ids is not None and type(ids) is not list:
        raise _bad(rid, "prompt_token_ids", ids, f"must be a list of int, got {type(ids).__name__}")
    if not ids:
        ids = None
    if embeds is not None:
        if ids is not None:
            raise InvalidRequestError(
                f"request {rid!r}: give prompt_token_ids or prompt_embeds, not both"
            )
        n = _check_embeds(rid, embeds, hidden_size)
    elif ids is None:
        raise InvalidRequestError(
            f"request {rid!r}: empty prompt: give prompt_token_ids or prompt_embeds"
        )
    else:
        n = len(ids)
    if n > max_model_len:
        raise InvalidRequestError(
            f"request {rid!r}: prompt of {n} tokens is longer than max_model_len={max_model_len}"
        )
    if ids is not None:
        end = vocab_size if vocab_size is not None else _I64_END
        try:
            msgspec.convert(ids, _id_list(end))
        except msgspec.ValidationError:
            _raise_bad_ids(rid, ids, end)

    sp = r.sampling_params
    pp = r.pooling_params
    if pp is not None:
        if sp is not None:
            raise InvalidRequestError(
                f"request {rid!r}: give sampling_params or pooling_params, not both"
            )
        _check_pooling(rid, pp, pooling_tasks)
    elif sp is not None:
        _check_sampling(rid, sp)

    # The rest, inline (a function call per field would cost more than the checks).
    eos = r.eos_token_id
    if eos is not None and not _is_int(eos, 0, vocab_size if vocab_size is not None else _I64_END):
        raise _bad(rid, "eos_token_id", eos, "must be None or a token id in the vocabulary")
    at = r.arrival_time
    if not (type(at) is float and 0.0 <= at <= _FMAX) and not _is_number(at, 0.0, _FMAX):
        raise _bad(rid, "arrival_time", at, "must be a finite number >= 0")
    if r.lora_request is not None:
        _check_lora(rid, r.lora_request)
    if r.cache_salt is not None and type(r.cache_salt) is not str:
        raise _bad(rid, "cache_salt", r.cache_salt, "must be None or a str")
    dpr = r.data_parallel_rank
    if dpr is not None and not _is_int(dpr, 0, _I64_END):
        raise _bad(rid, "data_parallel_rank", dpr, "must be None or an int >= 0")
    x = r.client_index
    if type(x) is not int or not 0 <= x < _I64_END:
        raise _bad(rid, "client_index", x, "must be an int >= 0")
    x = r.current_wave
    if type(x) is not int or not 0 <= x < _I64_END:
        raise _bad(rid, "current_wave", x, "must be an int >= 0")
    x = r.priority
    if type(x) is not int or not _I64_MIN <= x < _I64_END:
        raise _bad(rid, "priority", x, "must be a 64-bit int")


def _raise_bad_ids(rid: str, ids: list, end: int) -> None:
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise InvalidRequestError(
                f"request {rid!r}: prompt_token_ids[{i}]={_short(t)} is invalid: token ids "
                f"must be int, got {type(t).__name__}"
            )
        if not 0 <= t < end:
            raise InvalidRequestError(
                f"request {rid!r}: prompt_token_ids[{i}]={t} is outside the vocabulary [0, {end})"
            )
    raise AssertionError("unreachable")  # pragma: no cover


def _check_embeds(rid: str, embeds: Any, hidden: int | None) -> int:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(embeds, torch.Tensor):
        raise _bad(
            rid, "prompt_embeds", type(embeds).__name__,
            "must be a torch.Tensor of shape [num_tokens, hidden_size]",
        )
    shape = list(embeds.shape)
    if len(shape) != 2 or (hidden is not None and shape[1] != hidden):
        want = hidden if hidden is not None else "hidden_size"
        raise InvalidRequestError(
            f"request {rid!r}: prompt_embeds must have shape [num_tokens, {want}] "
            f"(expected hidden size {want}: the model's hidden_size), got {shape}"
        )
    if not embeds.dtype.is_floating_point:
        raise InvalidRequestError(
            f"request {rid!r}: prompt_embeds must be floating point, got {embeds.dtype}"
        )
    if shape[0] == 0:
        raise InvalidRequestError(f"request {rid!r}: empty prompt: prompt_embeds has no rows")
    try:
        finite = bool(torch.isfinite(embeds).all())
    except (NotImplementedError, RuntimeError):
        # No isfinite for this dtype (float8_e4m3fn, float8_e5m2fnuz, ...): in float32,
        # which holds every value of those; a dtype with no float32 form is refused.
        try:
            finite = bool(torch.isfinite(embeds.float()).all())
        except (NotImplementedError, RuntimeError, TypeError) as e:
            raise InvalidRequestError(
                f"request {rid!r}: prompt_embeds has dtype {embeds.dtype}, which cannot be "
                f"checked or computed with ({type(e).__name__}: {e})") from None
    if not finite:
        raise InvalidRequestError(f"request {rid!r}: prompt_embeds holds NaN or infinite values")
    return shape[0]


def _check_sampling(rid: str, sp: Any) -> None:
    if type(sp) is not SamplingParams and not isinstance(sp, SamplingParams):
        raise _bad(rid, "sampling_params", sp, f"must be a SamplingParams, got {type(sp).__name__}")
    x = sp.max_tokens
    if type(x) is not int or not 1 <= x < _I64_END:
        raise _bad_sp(rid, sp, "max_tokens", "must be an int >= 1")
    x = sp.temperature
    if not (type(x) is float and 0.0 <= x <= _FMAX) and not _is_number(x, 0.0, _FMAX):
        raise _bad_sp(rid, sp, "temperature", "must be a finite number >= 0")
    x = sp.top_p
    if not (type(x) is float and 0.0 < x <= 1.0) and not (type(x) is int and x == 1):
        raise _bad_sp(rid, sp, "top_p", "must be a number in (0, 1]")
    x = sp.top_k
    if type(x) is not int or not -1 <= x < _I64_END:
        raise _bad_sp(rid, sp, "top_k", "must be an int >= -1 (0 or -1: off)")
    x = sp.seed
    if x is not None and (type(x) is not int or not _I64_MIN <= x < _U64_END):
        raise _bad_sp(rid, sp, "seed", "must be None or an int in [-2**63, 2**64)")
    x = sp.stop_token_ids
    if type(x) is not list:
        raise _bad_sp(rid, sp, "stop_token_ids", "must be a list of 64-bit int")
    if x:
        try:
            msgspec.convert(x, _I64_LIST)
        except msgspec.ValidationError:
            raise _bad_sp(rid, sp, "stop_token_ids", "must be a list of 64-bit int") from None
    if type(sp.ignore_eos) is not bool:
        raise _bad_sp(rid, sp, "ignore_eos", "must be a bool")


def _bad_sp(rid: str, sp: Any, field: str, why: str) -> InvalidRequestError:
    return _bad(rid, f"sampling_params.{field}", getattr(sp, field), why)


def _check_pooling(rid: str, pp: Any, tasks: tuple[str, ...]) -> None:
    if type(pp) is not PoolingParams and not isinstance(pp, PoolingParams):
        raise _bad(rid, "pooling_params", pp, f"must be a PoolingParams, got {type(pp).__name__}")
    if type(pp.task) is not str or pp.task not in tasks:
        raise _bad(
            rid, "pooling_params.task", pp.task,
            f"is not supported; supported: {', '.join(map(repr, tasks))}",
        )
    if type(pp.normalize) is not bool:
        raise _bad(rid, "pooling_params.normalize", pp.normalize, "must be a bool")


def _check_lora(rid: str, lora: Any) -> None:
    if not isinstance(lora, LoRARequest):
        raise _bad(rid, "lora_request", lora, f"must be a LoRARequest, got {type(lora).__name__}")
    if type(lora.lora_name) is not str or not lora.lora_name:
        raise _bad(rid, "lora_request.lora_name", lora.lora_name, "must be a non-empty str")
    if not _is_int(lora.lora_int_id, 1, _I64_END):
        raise _bad(rid, "lora_request.lora_int_id", lora.lora_int_id, "must be an int >= 1")
    if type(lora.lora_path) is not str:
        raise _bad(rid, "lora_request.lora_path", lora.lora_path, "must be a str")


def check_abort_ids(request_ids: Any) -> list[str]:
    """The ids of an ``abort_requests`` call as a fresh list of str. A single str (which
    would abort one request per character) and anything but an iterable of str raise
    ``InvalidRequestError``."""
    if isinstance(request_ids, (str, bytes, bytearray, memoryview)):
        raise InvalidRequestError(
            f"abort_requests() takes a list of request ids, got a single "
            f"{type(request_ids).__name__} {_short(request_ids)}; wrap it in a list"
        )
    if type(request_ids) is list:
        ids = request_ids.copy()
    else:
        try:
            ids = list(request_ids)
        except TypeError:
            raise InvalidRequestError(
                f"abort_requests() takes a list of request ids, got "
                f"{type(request_ids).__name__}"
            ) from None
    for i, rid in enumerate(ids):
        if type(rid) is not str:
            raise InvalidRequestError(
                f"abort_requests(): request_ids[{i}]={_short(rid)} is invalid: request ids "
                f"are str, got {type(rid).__name__}"
            )
    return ids


def check_utility_call(method: Any) -> None:
    """Raise ``InvalidRequestError`` unless ``method`` is a plausible utility name (a
    non-empty str). Whether the engine has it is for the engine to say."""
    if type(method) is not str or not method:
        raise InvalidRequestError(
            f"call_utility(): method={_short(method)} is invalid: must be a non-empty str "
            "naming an engine method"
        )


def check_timeout(what: str, timeout: Any) -> float | None:
    """``timeout`` of the call ``what`` as seconds or None; anything but None or a
    number >= 0 (NaN, a negative number, a str, a bool) raises ``InvalidRequestError``
    naming the call."""
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
            or not timeout >= 0):
        raise InvalidRequestError(
            f"{what}(): timeout={timeout!r} is invalid: must be a number of seconds >= 0 or None")
    try:
        return float(timeout)
    except OverflowError:  # an int past the largest float: no limit, as inf
        return math.inf
