"""The bounds of every numeric request field, and the one check that applies them.

Every route (OpenAI, native) and the Python ``Engine`` check numbers here, so a value is refused
the same way wherever it comes from: by type (``bool`` is not a number here), finiteness (no
NaN or infinity, and no integer too large to be a float) and range. Integers are bounded before
anything hands them to numpy or torch (whose int64 overflows where Python's ints do not).
``max_new_tokens`` has a second bound that needs the prompt: the context length, checked by the
engine once the prompt is tokenised (``check_context``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ParamError(ValueError):
    """A request field out of bounds; ``param`` names the field as the caller spelled it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Bound:
    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    also: tuple[int, ...] = ()  # values allowed outside [lo, hi] (top_k's -1)

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        if self.lo is not None and self.hi is not None:
            rng = f" in {'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(self.hi)}]"
        elif self.lo is not None:
            rng = f" {'>' if self.lo_open else '>='} {_fmt(self.lo)}"
        elif self.hi is not None:
            rng = f" <= {_fmt(self.hi)}"
        else:
            rng = ""
        alt = "".join(f" or {a}" for a in self.also)
        return f"{kind}{rng}{alt}"


# Loom's (SGLang's) names; the OpenAI routes map theirs onto these (``OPENAI_NAMES``).
BOUNDS: dict[str, Bound] = {
    # (and the context length, by check_context, which says both numbers)
    "max_new_tokens": Bound(True, 0, INT64_MAX),
    "min_new_tokens": Bound(True, 0, INT64_MAX),
    "temperature": Bound(False, 0),
    "top_p": Bound(False, 0, 1, lo_open=True),
    "top_k": Bound(True, 1, INT32_MAX, also=(-1,)),
    "min_p": Bound(False, 0, 1),
    "frequency_penalty": Bound(False, -2, 2),
    "presence_penalty": Bound(False, -2, 2),
    "repetition_penalty": Bound(False, 0, 2, lo_open=True),
    "logit_bias": Bound(False, -100, 100),  # each bias value
    "sampling_seed": Bound(True, INT64_MIN, INT64_MAX),
    "n": Bound(True, 1, 64),
    "stream_interval": Bound(True, 0, INT32_MAX),  # 0 (or null): every step
    "priority": Bound(True, -INT32_MAX - 1, INT32_MAX),
    "top_logprobs_num": Bound(True, 0, 20),
    "logprob_start_len": Bound(True, -1, INT32_MAX),
    "token_id": Bound(True, 0, INT32_MAX),  # and below the vocabulary size, where it is known
    # OpenAI-only fields
    "best_of": Bound(True, 1, 20),
    "completion_logprobs": Bound(True, 0, 5),  # completions' ``logprobs``
}

# OpenAI's spelling of a field -> Loom's (errors name the field as the request spelled it)
OPENAI_NAMES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "top_logprobs": "top_logprobs_num",
}


def _fmt(x: float) -> str:
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if isinstance(x, int) and abs(x) >= 2**31 - 1:
        exp = {INT32_MAX: "2**31 - 1", INT64_MAX: "2**63 - 1", -(2**31): "-2**31"}
        return exp.get(x, "-2**63" if x == INT64_MIN else str(x))
    return str(x)


def show(value: Any, limit: int = 60) -> str:
    """A short, safe rendering of a bad value for an error message (``repr`` of an integer with
    thousands of digits raises, and a megabyte string would flood the message)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except ValueError:  # (int -> str digit limit, inside a container)
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_number(
    name: str,
    value: Any,
    shown: str | None = None,
    hi: int | None = None,
    param: str | None = None,
) -> Any:
    """``value`` if it is within ``BOUNDS[name]`` (and, for integers, ``< hi`` when given);
    otherwise a ``ParamError`` whose message names the value as ``shown`` (default ``name``)
    and whose ``param`` is ``param`` (default ``shown``)."""
    b = BOUNDS[name]
    label = shown or name

    def fail(why: str | None = None) -> ParamError:
        message = f"{label} must be {why or b.describe()}, got {show(value)}"
        return ParamError(param or label, message)

    if isinstance(value, bool):
        raise fail()
    if b.integer:
        if not isinstance(value, int):
            raise fail()
        if value in b.also:
            return value
    else:
        if not isinstance(value, (int, float)):
            raise fail()
        try:
            if not math.isfinite(float(value)):
                raise fail()
        except OverflowError:  # an integer beyond float's range
            raise fail() from None
    if b.lo is not None and (value <= b.lo if b.lo_open else value < b.lo):
        raise fail()
    if b.hi is not None and value > b.hi:
        raise fail()
    if hi is not None and value >= hi:
        raise fail(f"{b.describe()} and < {hi}")
    return value


def check_context(prompt_len: int, max_new_tokens: int, context_len: int) -> None:
    """The prompt and the requested new tokens must fit the context (vLLM's and OpenAI's
    answer: a 400 that says both numbers)."""
    if prompt_len + max_new_tokens > context_len:
        raise ParamError(
            "max_new_tokens",
            f"this model's maximum context length is {context_len} tokens, but "
            f"{prompt_len + max_new_tokens} were requested ({prompt_len} in the prompt, "
            f"{max_new_tokens} new): at most {max(context_len - prompt_len, 0)} new tokens fit; "
            "reduce the prompt or the maximum number of new tokens",
        )
