"""Which attention backends a model runner builds: the ``attention_backend`` members named by
``--attention-backend`` (or ``--prefill-attention-backend`` / ``--decode-attention-backend``
for one phase), or for ``auto`` the registered member of the highest ``auto_priority`` for the
device and phase that can be built. One instance per name serves both phases; two names make
a ``HybridAttnBackend``."""

from __future__ import annotations

import logging

from loom import plugins
from loom.layers.attention.base import AttentionBackend, AttentionContext

logger = logging.getLogger(__name__)


def build_attention_backends(
    ctx: AttentionContext, prefill: str, decode: str, mixed_first: bool = False
) -> tuple[AttentionBackend, str, str, str]:
    """The backend, its name, and each phase's member name. ``mixed_first``: extend batches
    go first to an ``auto`` member that captures mixed steps whole."""
    built: dict[str, AttentionBackend] = {}
    p_name = _pick(prefill, "prefill", ctx, built, mixed_first)
    d_name = _pick(decode, "decode", ctx, built, False)
    if p_name == d_name:
        return built[p_name], p_name, p_name, d_name
    from loom.layers.attention.hybrid import HybridAttnBackend

    hybrid = HybridAttnBackend(built[p_name], built[d_name])
    return hybrid, f"{p_name} prefill + {d_name} decode", p_name, d_name


def _pick(name: str, phase: str, ctx: AttentionContext, built: dict, mixed_first: bool) -> str:
    """Build ``name`` (into ``built``) for one phase; ``auto`` takes the registered backend
    of the highest ``auto_priority`` for this device and phase that :func:`_try` can build."""
    device = ctx.device
    if name != "auto":
        if name not in built:
            cls = plugins.resolve("attention_backend", name)
            if not cls.is_supported(device):
                raise ValueError(f"attention backend {name!r} does not support {device}")
            built[name] = cls(ctx)
        return name
    # With mixed chunks, extend batches go first to a backend that captures mixed steps
    # whole: as piecewise graphs a mixed step launches each layer's attention from the host
    # (SmolLM2 on the H200: 21.5 against 10.8 ms a step, bench/mixed_step_profile.py)
    ranked = []
    for candidate in plugins.names("attention_backend"):
        try:
            cls = plugins.resolve("attention_backend", candidate)
        except Exception as e:  # noqa: BLE001 - a member whose module cannot import
            logger.info("attention backend %s skipped for auto: %s", candidate, e)
            continue
        priority = cls.auto_priority(device, phase)
        if priority is not None:
            ranked.append((not (mixed_first and cls.supports_mixed_graph), -priority, candidate))
    for *_, candidate in sorted(ranked):
        if _try(candidate, phase, ctx, built):
            return candidate
    needs = f" with {', '.join(sorted(ctx.features))}" if ctx.features else ""
    raise ValueError(f"no attention backend supports {device} / {ctx.dtype}{needs}")


def _try(name: str, phase: str, ctx: AttentionContext, built: dict) -> bool:
    """Whether ``name`` can serve here, for ``auto``: registered, supporting the device and
    dtype, and constructed (a backend's constructor raises ValueError for shapes and KV
    dtypes it lacks) into ``built``."""
    if name in built:
        return True
    if name not in set(plugins.names("attention_backend")):
        return False
    cls = plugins.resolve("attention_backend", name)
    if not (cls.is_supported(ctx.device) and cls.supports_dtype(ctx.dtype)):
        return False
    try:
        built[name] = cls(ctx)
    except ValueError as e:
        logger.info("attention backend %s skipped for %s: %s", name, phase, e)
        return False
    return True
