"""Per-request sampling parameters (SGLang's names) and their validation."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

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
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        if "seed" in d:  # SGLang accepts both
            d.setdefault("sampling_seed", d.pop("seed"))
        known = {f.name for f in dataclasses.fields(cls)}
        for key in list(d):
            if key not in known:
                raise ValueError(
                    f"unknown sampling parameter {key!r}; valid: {', '.join(sorted(known))}"
                )
        if isinstance(d.get("logit_bias"), dict):
            try:
                d["logit_bias"] = {int(k): v for k, v in d["logit_bias"].items()}
            except (TypeError, ValueError) as e:
                raise ValueError("logit_bias keys must be token ids") from e
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
        num = (int, float)
        for name, lo, hi in (("frequency_penalty", -2, 2), ("presence_penalty", -2, 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, num) or not lo <= v <= hi:
                raise bad(name, f"must be in [{lo}, {hi}]")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, num) or not 0 < rp <= 2:
            raise bad("repetition_penalty", "must be in (0, 2]")
        if not isinstance(self.min_new_tokens, int) or self.min_new_tokens < 0:
            raise bad("min_new_tokens", "must be an integer >= 0")
        if isinstance(self.max_new_tokens, int) and self.min_new_tokens > self.max_new_tokens:
            raise bad("min_new_tokens", f"must be <= max_new_tokens ({self.max_new_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to numbers")
            for tok, b in self.logit_bias.items():
                if (
                    not isinstance(tok, int)
                    or tok < 0
                    or (vocab_size is not None and tok >= vocab_size)
                ):
                    raise bad("logit_bias", f"keys must be token ids in [0, {vocab_size})")
                if isinstance(b, bool) or not isinstance(b, num) or not -100 <= b <= 100:
                    raise bad("logit_bias", "values must be numbers in [-100, 100]")
        if not isinstance(self.n, int) or not 1 <= self.n <= 64:
            raise bad("n", "must be an integer in [1, 64]")
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
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0
            or self.presence_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
