"""Conformance kit of the lora_eviction_policy family."""

from __future__ import annotations

import random

from loom.testing._common import instantiate


def check_lora_eviction_policy(name: str, seed: int = 0) -> None:
    """Driven as the LoRA manager drives it (marks on use, a victim among idle loaded adapters,
    then its removal): every victim is one of the candidates, the choice is deterministic, and
    a removed adapter can be loaded and used again."""
    runs = []
    for _ in range(2):
        policy = instantiate("lora_eviction_policy", name)
        loaded: list[str] = []
        victims = []
        r = random.Random(seed)
        for _step in range(300):
            name_i = f"adapter-{r.randrange(12)}"
            if name_i not in loaded:
                if len(loaded) >= 4:
                    candidates = sorted(r.sample(loaded, r.randint(1, len(loaded))))
                    victim = policy.select_victim(list(candidates))
                    assert victim in candidates, (
                        f"{name}: select_victim returned {victim!r}, not one of {candidates}"
                    )
                    victims.append(victim)
                    policy.remove(victim)
                    loaded.remove(victim)
                loaded.append(name_i)
            policy.mark_used(name_i)
        runs.append(victims)
    assert runs[0] == runs[1], f"{name}: the same uses must give the same victims"
