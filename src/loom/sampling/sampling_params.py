"""Per-request sampling parameters (SGLang's names) and their validation."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# Parameters SGLang accepts that belong to later work: accepted by name so clients need not change,
# rejected with a clear error when set to anything but the neutral value, never silently ignored.
_NOT_YET = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "logit_bias": None,
    "n": 1,
    "no_stop_trim": False,
    "spaces_between_special_tokens": True,
}


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
    # Structured output: at most one (a JSON schema may be given as an object or its text).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        if "seed" in d:  # SGLang accepts both
            d.setdefault("sampling_seed", d.pop("seed"))
        known = {f.name for f in dataclasses.fields(cls)}
        for key in list(d):
            if key in _NOT_YET:
                value = d.pop(key)
                if value is not None and value != _NOT_YET[key]:
                    raise ValueError(f"sampling parameter {key!r} is not supported yet")
            elif key not in known:
                raise ValueError(
                    f"unknown sampling parameter {key!r}; valid: "
                    f"{', '.join(sorted(known | set(_NOT_YET)))}"
                )
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        proc = d.get("custom_logit_processor")
        if isinstance(proc, dict):  # {"name": ..., "params": {...}}
            d["custom_logit_processor"] = proc.get("name")
            d.setdefault("custom_params", proc.get("params") or {})
        for key in ("json_schema", "structural_tag"):
            if isinstance(d.get(key), (dict, list)):
                d[key] = json.dumps(d[key])
        params = cls(**d)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "must be an integer >= 0")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of token ids")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be < vocab size {vocab_size}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a string or a list of non-empty strings")
        if self.sampling_seed is not None and not isinstance(self.sampling_seed, int):
            raise bad("sampling_seed", "must be an integer")
        if not isinstance(self.custom_params, dict):
            raise bad("custom_params", "must be a JSON object")
        given = [k for k in CONSTRAINTS if getattr(self, k) is not None]
        for k in given:
            if not isinstance(getattr(self, k), str) or not getattr(self, k):
                raise bad(k, "must be a non-empty string")
        if len(given) > 1:
            raise ValueError(
                f"at most one of {', '.join(CONSTRAINTS)} per request, got {', '.join(given)}"
            )

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the request's structured-output constraint, if any."""
        for k in CONSTRAINTS:
            if getattr(self, k) is not None:
                return k, getattr(self, k)
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
