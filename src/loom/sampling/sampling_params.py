"""Per-request sampling parameters (SGLang's names) and their validation.

Every field of SGLang's ``SamplingParams`` is accepted: those below, and the two Loom cannot
honour (``UNSUPPORTED``), refused by name unless they ask for nothing. As in SGLang, a field
given as ``null`` takes its default (``max_new_tokens: null`` is "what the context leaves",
resolved by the engine once the prompt is known), and an empty structured-output constraint is
no constraint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from loom.sampling.limits import ParamError, check_number, show

CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")
# SGLang sampling parameters Loom does not implement: refused unless null.
UNSUPPORTED = {
    "beam_width": "beam search is not supported",
    "watermark": "watermarking is not supported",
}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)  # stop once the text matches one
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None  # the processor's parameters (None: not given)
    frequency_penalty: float = 0.0  # OpenAI: minus penalty x count of the token in the output
    presence_penalty: float = 0.0  # OpenAI: minus penalty if the token is in the output
    repetition_penalty: float = 1.0  # HF/CTRL: divide (positive) or multiply logits of seen tokens
    min_new_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to the logit
    n: int = 1
    no_stop_trim: bool = False  # keep the matched stop (string, regex match, token) in the text
    # Accepted as SGLang does: it passes it to tokenizer.decode, which fast tokenizers ignore
    spaces_between_special_tokens: bool = True
    stream_interval: int | None = None  # stream every this many tokens (None or 0: every step)
    # Structured output: at most one (a JSON schema may be given as an object or its text).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # steer a constrained answer onto a short completion of its grammar when the tokens left
    # run out (``constrained/closing.py``); None: the server's default
    close_within_budget: bool | None = None

    @classmethod
    def from_dict(
        cls, d: dict[str, Any] | None, names: dict[str, str] | None = None
    ) -> SamplingParams:
        """Parameters from a request's dict, validated (``names``: as in ``validate``)."""
        if d is not None and not isinstance(d, dict):
            raise ParamError("sampling_params", "sampling_params must be an object")
        # null is the default (SGLang), so is an empty constraint
        d = {
            k: v
            for k, v in (d or {}).items()
            if v is not None and not (k in CONSTRAINTS and v == "")
        }
        names = dict(names or {})
        if "seed" in d:  # SGLang accepts both
            names.setdefault("sampling_seed", "seed")
            d.setdefault("sampling_seed", d.pop("seed"))
        known = {f.name for f in dataclasses.fields(cls)}
        for key in list(d):
            if key in UNSUPPORTED:
                raise ParamError(key, f"{key}: {UNSUPPORTED[key]} (give null or leave it out)")
            if not isinstance(key, str) or key not in known:
                raise ParamError(
                    str(key),
                    f"unknown sampling parameter {show(key)}; valid: {', '.join(sorted(known))}",
                )
        if isinstance(d.get("logit_bias"), dict):
            try:
                d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
            except (TypeError, ValueError, OverflowError) as e:
                raise ParamError("logit_bias", "logit_bias keys must be token ids") from e
        for key in ("stop", "stop_regex"):
            if isinstance(d.get(key), str):
                d[key] = [d[key]]
        proc = d.get("custom_logit_processor")
        if isinstance(proc, dict):  # {"name": ..., "params": {...}}
            d["custom_logit_processor"] = proc.get("name")
            d.setdefault("custom_params", proc.get("params") or {})
        for key in ("json_schema", "structural_tag"):
            if isinstance(d.get(key), (dict, list)):
                try:
                    d[key] = json.dumps(d[key])
                except (ValueError, TypeError, RecursionError) as e:
                    raise ParamError(key, f"{key} is not a JSON document: {e}") from None
        params = cls(**d)
        params.validate(names=names)
        return params

    def validate(self, vocab_size: int | None = None, names: dict[str, str] | None = None) -> None:
        """Check every field (numbers through ``limits.check_number``, the one place their
        bounds live). ``names``: how the caller spells fields (OpenAI's ``max_tokens`` for
        ``max_new_tokens``), for the error's message and ``param``."""
        names = names or {}

        def num(name: str, value: Any = None, hi: int | None = None) -> None:
            value = getattr(self, name) if value is None else value
            check_number(name, value, names.get(name, name), hi)

        def bad(name: str, why: str) -> ParamError:
            label = names.get(name, name)
            return ParamError(label, f"{label} {why}, got {show(getattr(self, name))}")

        for name in (
            "max_new_tokens",
            "min_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "n",
        ):
            num(name)
        if self.sampling_seed is not None:
            num("sampling_seed")
        if self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens})")
        if not isinstance(self.stop_token_ids, list):
            raise bad("stop_token_ids", "must be a list of token ids")
        for t in self.stop_token_ids:
            check_number("token_id", t, names.get("stop_token_ids", "stop_token_ids"), vocab_size)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a string or a list of non-empty strings")
        self._validate_stop_regex(names.get("stop_regex", "stop_regex"))
        if self.stream_interval is not None:
            num("stream_interval")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "no_stop_trim",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        if self.close_within_budget is not None and not isinstance(self.close_within_budget, bool):
            raise bad("close_within_budget", "must be a boolean or null")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise bad("custom_params", "must be a JSON object")
        if self.custom_logit_processor is not None and not isinstance(
            self.custom_logit_processor, str
        ):
            raise bad(
                "custom_logit_processor",
                "must be a processor's name or SGLang's serialised processor (a string)",
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to numbers")
            label = names.get("logit_bias", "logit_bias")
            for tok, b in self.logit_bias.items():
                check_number("token_id", tok, f"{label} key", vocab_size, param=label)
                check_number("logit_bias", b, f"{label}[{tok}]", param=label)
        given = [k for k in CONSTRAINTS if getattr(self, k) is not None]
        for k in given:
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise bad(k, "must be a non-empty string")
        if len(given) > 1:
            raise ParamError(
                given[-1],
                f"at most one of {', '.join(CONSTRAINTS)} per request, got {', '.join(given)}",
            )

    def _validate_stop_regex(self, label: str) -> None:
        from loom.sampling.stop_regex import MAX_PATTERNS, compile_stop_regex

        pats = self.stop_regex
        if not isinstance(pats, list) or not all(isinstance(p, str) and p for p in pats):
            raise ParamError(
                label,
                f"{label} must be a pattern or a list of non-empty patterns, got {show(pats)}",
            )
        if len(pats) > MAX_PATTERNS:
            raise ParamError(label, f"{label}: at most {MAX_PATTERNS} patterns, got {len(pats)}")
        for p in pats:
            try:
                compile_stop_regex(p)
            except ValueError as e:
                raise ParamError(label, f"{label} {show(p)} {e}") from None

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the request's structured-output constraint, if any."""
        for k in CONSTRAINTS:
            if getattr(self, k) is not None:
                return k, getattr(self, k)
        return None

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
