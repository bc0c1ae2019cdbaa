"""Per-request sampling parameters (SGLang's names) and their validation."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from loom.sampling.limits import ParamError, check_number, show

CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] = field(default_factory=dict)
    frequency_penalty: float = 0.0  # OpenAI: minus penalty x count of the token in the output
    presence_penalty: float = 0.0  # OpenAI: minus penalty if the token is in the output
    repetition_penalty: float = 1.0  # HF/CTRL: divide (positive) or multiply logits of seen tokens
    min_new_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to the logit
    n: int = 1
    no_stop_trim: bool = False  # keep the matched stop string in the text
    spaces_between_special_tokens: bool = True
    # Structured output: at most one (a JSON schema may be given as an object or its text).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(
        cls, d: dict[str, Any] | None, names: dict[str, str] | None = None
    ) -> SamplingParams:
        """Parameters from a request's dict, validated (``names``: as in ``validate``)."""
        if d is not None and not isinstance(d, dict):
            raise ParamError("sampling_params", "sampling_params must be an object")
        d = dict(d or {})
        names = dict(names or {})
        if "seed" in d:  # SGLang accepts both
            names.setdefault("sampling_seed", "seed")
            d.setdefault("sampling_seed", d.pop("seed"))
        known = {f.name for f in dataclasses.fields(cls)}
        for key in list(d):
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
        for key in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
            if d.get(key) is None:
                d.pop(key, None)
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
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
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        if not isinstance(self.custom_params, dict):
            raise bad("custom_params", "must be a JSON object")
        if self.custom_logit_processor is not None and not isinstance(
            self.custom_logit_processor, str
        ):
            raise bad("custom_logit_processor", "must be a processor's name")
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
