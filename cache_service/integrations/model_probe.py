"""Construction probe: does a model, routed to the service, compute what transformers does?

:class:`~cache_service.integrations.transformers.ServiceModel` runs a short greedy
generation (a left-padded batch of two random prompts, a few new tokens) twice before it
accepts a model: once with the model's own attention and cache, once through the service
path (its hooks, :class:`GenerationSession`, ``service_attention_forward``) with
:class:`ExactAttentionService` standing in for the service. The stand-in computes exactly
what the service computes (dense causal softmax, scale ``head_dim ** -0.5``, contiguous GQA
groups, K/V stored in the service's KV dtype), so any difference in the logits means the
model's attention is something the service does not compute (sinks, biases, masks, a layer
that skips the attention interface, ...) and the model is refused.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MIN_PROBE_PROMPT",
    "PROBE_NEW_TOKENS",
    "PROBE_PROMPT",
    "ExactAttentionService",
    "ProbeResult",
    "compare_generations",
    "probe_generation_config",
    "probe_inputs",
    "rounding_noise",
]

PROBE_NEW_TOKENS = 3
"""Tokens the probe generates (one prefill step and two decode steps)."""

PROBE_PROMPT = 6
"""Tokens of the longer probe row (fewer for a model whose window is shorter); the other
row has 2 tokens fewer (left padding)."""

MIN_PROBE_PROMPT = 3

# Largest |logit difference| accepted, relative to max(1, largest |logit|), by model dtype:
# the two runs differ only in how the attention sums are ordered and rounded.
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}

NOISE_FACTOR = 2.0
"""How far beyond the model's own rounding noise the service path may differ: a deep, wide
model in 16-bit floats amplifies rounding differences layer after layer, so that its own
two attention implementations (sdpa and eager) may disagree by more than the dtype's
tolerance; the probe then accepts up to this multiple of their disagreement."""

MAX_NOISE_TOLERANCE = 4.0
"""The most the rounding noise may widen the tolerance, as a multiple of the dtype's: an
attention the service does not compute (a missing softcap, another scale, a bias) moves
the logits by a large fraction of their scale, far beyond this."""


@dataclass
class _Handle:
    seq_id: str
    num_cached_tokens: int


class ExactAttentionService:
    """In-memory stand-in for the service's append-and-attend, for the construction probe.

    Holds per sequence and layer the keys/values written (in ``kv_dtype``) and attends each
    new query causally over them: query head ``h`` reads KV head ``h // (Hq / Hkv)``, scores
    scaled by ``head_dim ** -0.5``, softmax in float32, output in the query's dtype.

    Attributes:
        layers_seen: service layers that received an append, in call order.
    """

    def __init__(self, kv_dtype: torch.dtype) -> None:
        self._kv_dtype = kv_dtype
        self._kv: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._next = 0
        self.layers_seen: list[int] = []

    def create_sequence(
        self, prompt_token_ids: Sequence[int] | None = None, *, namespace: str = ""
    ) -> _Handle:
        """A new empty sequence (the stand-in caches no prefixes)."""
        self._next += 1
        return _Handle(seq_id=f"probe-{self._next}", num_cached_tokens=0)

    def create_sequences(
        self, prompts: Sequence[Sequence[int] | None], *, namespace: str = ""
    ) -> list[_Handle]:
        """A new empty sequence per prompt."""
        return [self.create_sequence(p, namespace=namespace) for p in prompts]

    def free(self, seq_id: str) -> None:
        """Forget a sequence's keys and values."""
        for key in [k for k in self._kv if k[0] == seq_id]:
            del self._kv[key]

    def free_sequences(self, seq_ids: Sequence[str]) -> None:
        """Forget these sequences' keys and values."""
        for seq_id in seq_ids:
            self.free(seq_id)

    def append_attend(self, layer: int, items: Sequence[Any]) -> list[torch.Tensor]:
        """Per item: append ``key``/``value`` ``[n, kv_heads, d]``, attend ``query`` ``[n, q_heads, d]``."""
        self.layers_seen.append(layer)
        return [self._one(layer, i.seq_id, i.key, i.value, i.query) for i in items]

    def append_attend_batch(
        self,
        layer: int,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
    ) -> torch.Tensor:
        """The batch form: ``key``/``value`` ``[b, n, kv_heads, d]``, ``query`` ``[b, n, q_heads, d]``."""
        self.layers_seen.append(layer)
        outs = [self._one(layer, s, key[b], value[b], query[b]) for b, s in enumerate(seq_ids)]
        return torch.stack(outs)

    def _one(
        self,
        layer: int,
        seq_id: str,
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
    ) -> torch.Tensor:
        n, num_q, d = query.shape
        num_kv = key.shape[1]
        if num_q % num_kv:
            raise ValueError(f"{num_q} query heads are not a multiple of {num_kv} KV heads")
        old = self._kv.get((seq_id, layer))
        k_new, v_new = key.to(self._kv_dtype), value.to(self._kv_dtype)
        k_all = k_new if old is None else torch.cat([old[0], k_new])
        v_all = v_new if old is None else torch.cat([old[1], v_new])
        self._kv[(seq_id, layer)] = (k_all, v_all)
        total = k_all.shape[0]
        group = num_q // num_kv
        kf = k_all.float().repeat_interleave(group, dim=1)  # [total, q_heads, d]
        vf = v_all.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,thd->hnt", query.float(), kf) / math.sqrt(d)
        q_pos = torch.arange(total - n, total).unsqueeze(1)
        k_pos = torch.arange(total).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        out = torch.einsum("hnt,thd->nhd", scores.softmax(dim=-1), vf)
        return out.to(query.dtype)


def probe_inputs(
    vocab_size: int, pad_token_id: int, length: int = PROBE_PROMPT
) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of two random prompts: (input_ids, attention_mask) ``[2, length]``
    int64, the second row with 2 padding columns."""
    g = torch.Generator().manual_seed(1234)
    high = max(2, min(int(vocab_size), 1000))
    ids = torch.randint(0, high, (2, length), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :2] = pad_token_id
    mask[1, :2] = 0
    return ids, mask


def probe_generation_config(model: Any, pad_token_id: int) -> Any:
    """The model's generation config made greedy, fixed-length and plain for the probe."""
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample = False
    gc.num_beams = 1
    gc.num_return_sequences = 1
    gc.max_new_tokens = PROBE_NEW_TOKENS
    gc.min_new_tokens = None
    gc.max_length = None
    gc.eos_token_id = None
    gc.pad_token_id = pad_token_id
    gc.return_dict_in_generate = True
    gc.output_logits = True
    gc.output_scores = False
    if hasattr(gc, "cache_implementation"):
        gc.cache_implementation = None
    return gc


@dataclass(frozen=True)
class ProbeResult:
    """How the service path's probe generation compared with the model's own.

    Attributes:
        worst: largest |logit difference| over the compared steps.
        tolerance: the largest accepted.
        step: the first step whose logits differ beyond tolerance (None = none).
    """

    worst: float
    tolerance: float
    step: int | None


def compare_generations(ours: Any, ref: Any, dtype: torch.dtype, noise: float = 0.0) -> ProbeResult:
    """Compare two ``generate`` outputs (``return_dict_in_generate``, ``output_logits``).

    Steps are compared while both runs chose the same tokens; a step whose tokens differ
    ends the comparison (the runs no longer see the same inputs), and only counts as a
    match if its logits agreed (a near tie broken differently).

    Args:
        dtype: the model's dtype (its tolerance, relative to the largest |logit|).
        noise: how much two of the model's own attention implementations disagree
            (:func:`rounding_noise`; logits' units): the tolerance is at least
            ``NOISE_FACTOR`` times it, and at most ``MAX_NOISE_TOLERANCE`` times the
            dtype's.
    """
    scale = max(1.0, max(float(r.float().abs().max()) for r in ref.logits))
    base = _TOLERANCE.get(dtype, 3e-2) * scale
    tolerance = min(max(base, NOISE_FACTOR * noise), MAX_NOISE_TOLERANCE * base)
    worst = 0.0
    for i, diff in enumerate(_step_differences(ours, ref)):
        worst = max(worst, diff)
        if diff > tolerance:
            return ProbeResult(worst, tolerance, i)
    return ProbeResult(worst, tolerance, None)


def rounding_noise(ref: Any, other: Any) -> float:
    """How much two generations of the same model with two attention implementations
    (sdpa and eager: the same arithmetic, summed and rounded in another order) disagree:
    the largest |logit difference| over the steps where they chose the same tokens, the
    first that differs included (logits' units)."""
    return max(_step_differences(other, ref), default=0.0)


def _step_differences(ours: Any, ref: Any) -> Iterator[float]:
    """The largest |logit difference| of each step (inf for a non-finite one), while both
    generations chose the same tokens: the step whose tokens differ is the last (the runs
    no longer see the same inputs after it)."""
    prompt = ours.sequences.shape[1] - len(ours.logits)
    for i, (a, b) in enumerate(zip(ours.logits, ref.logits, strict=True)):
        diff = float((a.float() - b.float()).abs().max())
        yield diff if math.isfinite(diff) else math.inf
        col = prompt + i
        if not torch.equal(ours.sequences[:, col], ref.sequences[:, col]):
            return
