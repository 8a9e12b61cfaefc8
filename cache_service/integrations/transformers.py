"""Hugging Face transformers causal LMs whose KV cache and attention live in the service.

How a forward pass reaches the service:

1. :class:`ServiceModel` routes every attention layer of the model to
   :func:`service_attention_forward` (registered in transformers' ``AttentionInterface``
   as ``"kvcache_service"``) and installs a forward pre-hook on the model.
2. A :class:`GenerationSession` owns one service sequence per batch row. Its
   :class:`ServiceKVCache` is what ``generate()`` gets as ``past_key_values``: a
   ``transformers.Cache`` that stores nothing and reports how many columns the model has
   already processed, so ``generate()`` feeds only the columns still missing (after a
   prefix hit the prefill starts at the first uncached prompt token).
3. Per forward, the pre-hook reads the step's token ids and attention mask, checks them
   against the session, plans which columns of each row are new to the service (padding
   and cached columns are skipped) and hands the plan to the attention layers through a
   forward keyword.
4. Each attention layer, after the model applied its rotary embedding, sends the new
   keys/values and queries of every row in one RPC (``append_attend_batch`` when every row
   sends as many tokens, as in decode; ``append_attend`` otherwise) and returns the
   service's output in the layout transformers expects ``[batch, q_len, q_heads,
   head_dim]``. Columns that were not sent (padding, cached prefix) get zeros: nothing
   downstream reads them, because later layers' keys for those columns are never sent and
   only the last column's logits pick the next token.

Only the model's own computation (embeddings, projections, rotary, MLP, sampling) stays
local; the cache and the attention are the service's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from cache_service.client import AppendAttendItem, DataLossError, NotFoundError
from cache_service.integrations.batch_plan import BatchPlan, StepPlan
from cache_service.integrations.model_features import (
    AttentionSpan,
    attention_span,
    describe_model,
    unsupported_features,
)
from cache_service.integrations.model_probe import (
    MIN_PROBE_PROMPT,
    PROBE_NEW_TOKENS,
    PROBE_PROMPT,
    ExactAttentionService,
    compare_generations,
    probe_generation_config,
    probe_inputs,
)

if TYPE_CHECKING:
    from cache_service.client import SequenceHandle

__all__ = [
    "SERVICE_ATTENTION",
    "GenerationSession",
    "ModelLayout",
    "ServiceKVCache",
    "ServiceModel",
    "SessionConfig",
    "SessionStats",
    "model_layout",
    "model_namespace",
    "service_attention_forward",
]

SERVICE_ATTENTION = "kvcache_service"
"""The ``attn_implementation`` name under which the service attention is registered."""

# Forward keyword carrying the active step from the model's pre-hook down to each attention
# layer (transformers forwards unknown keywords to the attention function).
_STEP_KWARG = "kvcache_step"

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class ServiceClient(Protocol):
    """What the adapter needs of ``cache_service.client.KVCacheClient``."""

    def info(self) -> Any: ...

    def create_sequence(
        self, prompt_token_ids: Sequence[int] | None = None, *, namespace: str = ""
    ) -> SequenceHandle: ...

    def free(self, seq_id: str) -> None: ...

    def append_attend(self, layer: int, items: list[AppendAttendItem]) -> list[torch.Tensor]: ...

    def append_attend_batch(
        self,
        layer: int,
        seq_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        key: torch.Tensor,
        value: torch.Tensor,
        query: torch.Tensor,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelLayout:
    """The attention shape of a model, as the service's layout must match it.

    Attributes:
        num_layers: attention layers (service layers ``0 .. num_layers - 1``).
        num_q_heads: query heads per layer.
        num_kv_heads: key/value heads per layer (``num_q_heads`` is a multiple: GQA/MQA).
        head_dim: channels per head.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def model_layout(model: PreTrainedModel) -> ModelLayout:
    """Read the attention shape of a decoder-only transformers model from its config."""
    cfg = model.config.get_text_config(decoder=True)
    try:
        num_q = int(cfg.num_attention_heads)
        num_layers = int(cfg.num_hidden_layers)
        num_kv = int(getattr(cfg, "num_key_value_heads", None) or num_q)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_q
    except Exception as e:
        raise ValueError(
            f"{describe_model(model)}: its config gives no single attention shape (layers, "
            f"heads, head_dim) for the service's layout ({type(e).__name__}: {e})"
        ) from e
    return ModelLayout(
        num_layers=num_layers,
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        head_dim=int(head_dim),
    )


_SAMPLES_PER_TENSOR = 64  # strided elements of each weight tensor in the model fingerprint


def model_namespace(model: PreTrainedModel) -> str:
    """A prefix-cache namespace naming this model: ``"hf-model:<hex sha256 prefix>"``.

    Digests the config (``to_json_string``), ``name_or_path`` and, for every parameter
    and buffer, its name, shape, dtype and up to 64 evenly strided elements, so two models
    of one config with different weights (two random initialisations, two fine-tunes)
    differ, while the same weights give the same namespace in any process. Costs one small
    gather per tensor (about a millisecond per hundred tensors on a GPU).
    """
    h = hashlib.sha256()
    config = model.config
    h.update(config.to_json_string(use_diff=False).encode())
    h.update(str(getattr(config, "name_or_path", "")).encode())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            flat = tensor.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            stride = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::stride][:_SAMPLES_PER_TENSOR].to("cpu", torch.float64)
            h.update(sample.numpy().tobytes())
    return "hf-model:" + h.hexdigest()[:48]


@dataclass(frozen=True)
class SessionConfig:
    """How a :class:`GenerationSession` uses the service.

    Attributes:
        reuse_prefix: create each sequence with its prompt so the service adopts the longest
            cached prefix (the prefill then computes only the rest). False starts every
            sequence empty.
        free_on_close: free the sequences when the session closes. Their full blocks stay
            in the service's prefix cache either way.
    """

    reuse_prefix: bool = True
    free_on_close: bool = True


@dataclass
class SessionStats:
    """What a session sent to the service (counts are per layer: every layer sends the same).

    Attributes:
        cached_tokens: per row, prompt tokens the service already held at creation.
        prompt_tokens: per row, prompt length without padding.
        step_columns: per forward, columns the model computed.
        step_tokens: per forward, tokens sent to the service for each row.
        rpc_calls: append-and-attend calls (one per layer per forward).
        rpc_seconds: wall time spent inside them, seconds.
    """

    cached_tokens: list[int]
    prompt_tokens: list[int]
    step_columns: list[int] = field(default_factory=list)
    step_tokens: list[list[int]] = field(default_factory=list)
    rpc_calls: int = 0
    rpc_seconds: float = 0.0

    @property
    def prefill_tokens(self) -> list[int]:
        """Per row, tokens the first forward (the prefill) sent."""
        return list(self.step_tokens[0]) if self.step_tokens else []


class _ServiceCacheLayer(CacheLayerMixin):
    """One layer of :class:`ServiceKVCache`: keeps no tensors, reports the session's length."""

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, session: GenerationSession) -> None:
        super().__init__()
        self._session = session
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the keys and values live in the service."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the new keys/values unchanged: the attention layer sends them on."""
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) in columns, as if the processed columns were stored here."""
        return self._session.plan.consumed + query_length, 0

    def get_seq_length(self) -> int:
        """Columns of the padded batch the model has processed (or may skip)."""
        return self._session.plan.consumed

    def get_max_length(self) -> int:
        """No fixed maximum: the service grows sequences block by block."""
        return -1

    def reset(self) -> None:
        raise NotImplementedError("a service session cannot be reset; open a new session")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(
            "beam search is not supported through the service (greedy/sampling only)"
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the service cache cannot be cropped (no assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "num_return_sequences > 1 / beams are not supported: open one row per sample"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the batch of a service session is fixed when it opens")


class ServiceKVCache(Cache):
    """The ``past_key_values`` to pass to ``generate()``: its KV lives in the service."""

    def __init__(self, session: GenerationSession, num_layers: int) -> None:
        super().__init__(layers=[_ServiceCacheLayer(session) for _ in range(num_layers)])
        self.session = session


class _ActiveStep:
    """One forward pass in flight: the plan, its token ids, and which layers have attended."""

    def __init__(self, session: GenerationSession, plan: StepPlan, token_ids: list[list[int]]):
        self.session = session
        self.plan = plan
        self.token_ids = token_ids  # per row: the ids of the tokens it sends this step
        self.layers_done: set[int] = set()


class GenerationSession:
    """One request: a left-padded batch whose rows are service sequences.

    Open it with :meth:`ServiceModel.session`; pass :attr:`cache` to ``generate()`` as
    ``past_key_values`` (or call :meth:`generate`). Closing frees the sequences.
    """

    def __init__(
        self,
        owner: ServiceModel,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        config: SessionConfig,
    ) -> None:
        if input_ids.ndim != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise ValueError(
                f"input_ids must be [batch, columns], got shape {tuple(input_ids.shape)}"
            )
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        mask = _normalise_mask(attention_mask, input_ids.shape)
        pads = _left_padding(mask)
        self._owner = owner
        self._config = config
        self.input_ids = input_ids.detach().cpu()
        self.attention_mask = mask
        prompts = [self.input_ids[b, pads[b] :].tolist() for b in range(len(pads))]
        owner.check_span(max(len(p) for p in prompts), 0)
        self._handles: list[SequenceHandle] = []
        self._closed = False
        self._broken: str | None = None
        self._active: _ActiveStep | None = None
        try:
            for prompt in prompts:
                handle = owner.client.create_sequence(
                    prompt if config.reuse_prefix else None, namespace=owner.namespace
                )
                self._handles.append(handle)
            cached = [int(h.num_cached_tokens) for h in self._handles]
            self._seq_ids = [h.seq_id for h in self._handles]
            self.plan = BatchPlan(pads, cached, int(input_ids.shape[1]))
        except BaseException:
            self._free_all(suppress=True)
            raise
        self.stats = SessionStats(cached_tokens=cached, prompt_tokens=[len(p) for p in prompts])
        self.cache = ServiceKVCache(self, owner.layout.num_layers)

    @property
    def seq_ids(self) -> list[str]:
        """Service sequence id of each row (kept after the session closes)."""
        return list(self._seq_ids)

    def generate(self, **generate_kwargs: Any) -> Any:
        """Run ``model.generate`` on the session's prompt with the service as KV cache.

        Keyword arguments go to ``generate`` (``max_new_tokens``, ``do_sample``, ...);
        ``input_ids``, ``attention_mask`` and ``past_key_values`` are the session's.
        """
        for key in ("input_ids", "attention_mask", "past_key_values", "use_cache"):
            if key in generate_kwargs:
                raise ValueError(f"{key!r} is set by the session; do not pass it")
        defaults = generate_kwargs.get("generation_config") or self._owner.model.generation_config
        for key in ("num_beams", "num_return_sequences"):
            if (generate_kwargs.get(key) or getattr(defaults, key, 1) or 1) > 1:
                # Both multiply the batch rows, and each row here is one service sequence.
                raise NotImplementedError(
                    f"{key} > 1 is not supported through the service: open one row per sample"
                )
        self._owner.check_span(
            max(self.stats.prompt_tokens), _new_tokens(generate_kwargs, defaults, self.plan)
        )
        device = self._owner.model.device
        return self._owner.model.generate(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            past_key_values=self.cache,
            use_cache=True,
            **generate_kwargs,
        )

    def close(self) -> None:
        """Free the sequences (if the config says so). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._owner._sessions.discard(self)
        if self._config.free_on_close:
            self._free_all(suppress=False)

    def __enter__(self) -> GenerationSession:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as close_error:  # the original error matters more
            exc.add_note(f"closing the service session also failed: {close_error!r}")

    # --- called by the model hooks and the attention function --------------------------

    def begin_step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> tuple[_ActiveStep, torch.Tensor]:
        """Check a forward's inputs against the session and plan what each row sends.

        Args:
            input_ids: int ``[batch, q]``, columns ``[consumed, consumed + q)`` of the batch.
            attention_mask: 0/1 ``[batch, consumed + q]`` or None.
            position_ids: int ``[batch or 1, q]`` or None.

        Returns:
            (the step, the position ids ``[batch, q]`` the model must use).
        """
        self._check_usable()
        plan = self.plan
        if input_ids.ndim != 2 or input_ids.shape[0] != plan.batch_size:
            raise ValueError(
                f"input_ids must be [{plan.batch_size}, q] for this session, got {tuple(input_ids.shape)}"
            )
        q = int(input_ids.shape[1])
        start = plan.consumed
        ids = input_ids.detach().cpu()
        if start < plan.prompt_columns:
            stop = min(start + q, plan.prompt_columns)
            if not torch.equal(ids[:, : stop - start], self.input_ids[:, start:stop]):
                raise ValueError(
                    f"input_ids columns {start}..{stop} differ from the session's prompt; "
                    "open a new session for another prompt"
                )
        if attention_mask is not None:
            self._check_mask(attention_mask, start, q)
        step = plan.plan(q)
        longest = max(r.start_position + r.count for r in step.rows)
        span = self._owner.span
        if span is not None and longest > span.size:
            raise NotImplementedError(
                f"{describe_model(self._owner.model)} limits attention to {span.size} tokens "
                f"({span.source}); this step would make a sequence {longest} tokens long, "
                "and the service computes full causal attention only"
            )
        expected_positions = torch.zeros(plan.batch_size, q, dtype=torch.long)
        token_ids = []
        for row in step.rows:
            offset = row.first_column - start
            expected_positions[row.row] = torch.arange(q) - offset + row.start_position
            token_ids.append(ids[row.row, offset:].tolist())
        if position_ids is not None:
            given = position_ids.detach().cpu().expand(plan.batch_size, q)
            for row in step.rows:
                offset = row.first_column - start
                if row.count and not torch.equal(
                    given[row.row, offset:], expected_positions[row.row, offset:]
                ):
                    raise ValueError(
                        f"row {row.row}: position_ids {given[row.row, offset:].tolist()} do not "
                        f"match the service positions starting at {row.start_position}"
                    )
        self._active = _ActiveStep(self, step, token_ids)
        return self._active, expected_positions.clamp_min(0)

    def end_step(self, step: _ActiveStep, failed: bool) -> None:
        """Commit a finished forward; a forward that failed or skipped layers breaks the session."""
        self._active = None
        missing = set(range(self._owner.layout.num_layers)) - step.layers_done
        if failed or missing:
            # Some layers may have written and others not: the sequences are inconsistent.
            self._broken = (
                f"forward step {step.plan.index} failed"
                if failed
                else f"layers {sorted(missing)} did not attend through the service"
            )
            if not failed:
                raise RuntimeError(
                    f"{self._broken}: the model is not routed to {SERVICE_ATTENTION!r}"
                )
            return
        self.plan.commit(step.plan)
        self.stats.step_columns.append(step.plan.num_columns)
        self.stats.step_tokens.append([r.count for r in step.plan.rows])

    def attend(
        self,
        step: _ActiveStep,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """Append one layer's new K/V and attend its queries, for every row, in one RPC.

        Args:
            layer: the model's layer index (= the service's).
            query: ``[batch, q_heads, q, head_dim]`` after rotary embedding.
            key, value: ``[batch, kv_heads, q, head_dim]`` after rotary embedding (keys).
            scaling: the model's softmax scale (None = ``head_dim ** -0.5``).

        Returns:
            ``[batch, q, q_heads, head_dim]`` in the query's dtype; zeros where nothing
            was sent (padding, cached prefix).
        """
        if step is not self._active:
            raise RuntimeError("attention called outside the session's current forward step")
        if layer in step.layers_done:
            raise RuntimeError(f"layer {layer} attended twice in one forward step")
        layout = self._owner.layout
        if not 0 <= layer < layout.num_layers:
            raise ValueError(
                f"attention layer_idx {layer} is outside the model's {layout.num_layers} layers"
            )
        batch, num_q_heads, q, head_dim = query.shape
        if (num_q_heads, head_dim, tuple(key.shape[1:])) != (
            layout.num_q_heads,
            layout.head_dim,
            (layout.num_kv_heads, q, head_dim),
        ) or tuple(value.shape) != tuple(key.shape):
            raise ValueError(
                f"layer {layer}: query {tuple(query.shape)} / key {tuple(key.shape)} do not "
                f"match the model layout {layout}"
            )
        rows = [r for r in step.plan.rows if r.count]
        width = max((r.count for r in rows), default=0)
        # One device-to-host copy per tensor per layer (the client sends CPU bytes), not one
        # per row; K/V go in the service's KV dtype, queries in the model's (the output
        # comes back in the query's dtype).
        kv_dtype = self._owner.kv_dtype
        q_host = query[:, :, q - width :, :].transpose(1, 2).to("cpu")
        k_host = key[:, :, q - width :, :].transpose(1, 2).to("cpu", kv_dtype)
        v_host = value[:, :, q - width :, :].transpose(1, 2).to("cpu", kv_dtype)
        # The service applies head_dim ** -0.5; another model scale is folded into the query.
        factor = 1.0 if scaling is None else scaling * math.sqrt(head_dim)
        if not math.isclose(factor, 1.0, rel_tol=1e-6):
            q_host = q_host * factor
        out = torch.zeros(batch, q, num_q_heads, head_dim, dtype=query.dtype)
        client = self._owner.client
        # Every row sending the same number of tokens (a decode step, an unpadded prefill):
        # the batch goes as [batch, ...] tensors, the cheaper form of the call.
        uniform = [r.row for r in rows] == list(range(batch)) and all(
            r.count == width for r in rows
        )
        t0 = time.perf_counter()
        try:
            if uniform:
                stacked = client.append_attend_batch(
                    layer,
                    [self._seq_ids[r.row] for r in rows],
                    [step.token_ids[r.row] for r in rows],
                    k_host,
                    v_host,
                    q_host,
                )
                outputs = list(stacked)
            else:
                items = [
                    AppendAttendItem(
                        seq_id=self._seq_ids[r.row],
                        token_ids=step.token_ids[r.row],
                        key=k_host[r.row, width - r.count :],
                        value=v_host[r.row, width - r.count :],
                        query=q_host[r.row, width - r.count :],
                    )
                    for r in rows
                ]
                outputs = client.append_attend(layer, items)
        except BaseException:
            self._broken = f"append_attend failed on layer {layer} of step {step.plan.index}"
            raise
        self.stats.rpc_seconds += time.perf_counter() - t0
        self.stats.rpc_calls += 1
        if len(outputs) != len(rows):
            raise RuntimeError(f"service returned {len(outputs)} outputs for {len(rows)} rows")
        for r, o in zip(rows, outputs, strict=True):
            if tuple(o.shape) != (r.count, num_q_heads, head_dim):
                raise RuntimeError(
                    f"service output for row {r.row} has shape {tuple(o.shape)}, "
                    f"expected {(r.count, num_q_heads, head_dim)}"
                )
            out[r.row, q - r.count :] = o
        step.layers_done.add(layer)
        return out.to(query.device)

    # --- helpers ------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the service session is closed")
        if self._broken is not None:
            raise RuntimeError(
                f"the service session is unusable ({self._broken}); its sequences may be "
                "partly written: close it and open a new one"
            )
        if self._active is not None:
            raise RuntimeError("a forward step of this session is already running")

    def _check_mask(self, attention_mask: torch.Tensor, start: int, q: int) -> None:
        if attention_mask.ndim != 2:
            raise ValueError(
                f"only 2D 0/1 attention masks are supported, got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask.shape != (self.plan.batch_size, start + q):
            raise ValueError(
                f"attention_mask must be [{self.plan.batch_size}, {start + q}] at this step, "
                f"got {tuple(attention_mask.shape)}"
            )
        got = attention_mask[:, start:].detach().cpu().to(torch.long)
        want = torch.tensor(self.plan.expected_mask(start, start + q), dtype=torch.long)
        if not torch.equal(got, want):
            raise ValueError(
                "attention_mask must keep the session's left padding and mark every new "
                f"column as a token (columns {start}..{start + q})"
            )

    def _free_all(self, suppress: bool) -> None:
        """Free every sequence (trying all of them); raise the first failure unless suppress."""
        errors = []
        for handle in self._handles:
            try:
                self._owner.client.free(handle.seq_id)
            except (NotFoundError, DataLossError):
                pass  # already gone (freed elsewhere, or lost with a worker)
            except Exception as e:
                errors.append(e)
        self._handles = []
        if errors and not suppress:
            raise RuntimeError(
                f"freeing {len(errors)} sequence(s) failed: {errors[0]!r}"
            ) from errors[0]


def _new_tokens(generate_kwargs: dict[str, Any], defaults: Any, plan: BatchPlan) -> int:
    """The most tokens ``generate()`` may add to a row, from its kwargs or generation config."""
    new = generate_kwargs.get("max_new_tokens")
    if new is None and "max_length" in generate_kwargs:
        return max(0, int(generate_kwargs["max_length"]) - plan.prompt_columns)
    if new is None:
        new = getattr(defaults, "max_new_tokens", None)
    if new is None:
        max_length = getattr(defaults, "max_length", None) or 20
        return max(0, int(max_length) - plan.prompt_columns)
    return int(new)


def _normalise_mask(attention_mask: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(tuple(shape), dtype=torch.long)
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids {tuple(shape)}"
        )
    mask = attention_mask.detach().cpu().to(torch.long)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    return mask


def _left_padding(mask: torch.Tensor) -> list[int]:
    """Padding columns per row; raises unless every row is ``0 .. 0 1 .. 1`` with a token."""
    pads = []
    for b in range(mask.shape[0]):
        row = mask[b]
        n_tokens = int(row.sum())
        if n_tokens == 0:
            raise ValueError(f"row {b} has no tokens (all padding)")
        pad = row.shape[0] - n_tokens
        if int(row[pad:].sum()) != n_tokens:
            raise ValueError(
                f"row {b} is not left-padded: the service needs padding_side='left' "
                "(all padding before the first token)"
            )
        pads.append(pad)
    return pads


def service_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: append + attend through the service.

    Args:
        module: the attention module (its ``layer_idx`` is the service layer).
        query: ``[batch, q_heads, q, head_dim]``; key/value ``[batch, kv_heads, q,
            head_dim]`` (only this step's tokens: :class:`ServiceKVCache` keeps nothing).
        attention_mask: ignored (the session knows the padding; attention is causal).

    Returns:
        (``[batch, q, q_heads, head_dim]``, None): no attention weights.
    """
    step = kwargs.get(_STEP_KWARG)
    if not isinstance(step, _ActiveStep):
        raise MissingStepError(
            f"attention {SERVICE_ATTENTION!r} of {type(module).__name__} received no service "
            f"step (the {_STEP_KWARG!r} keyword): either the model was not called through "
            "ServiceModel with past_key_values=session.cache, or its decoder layers do not "
            "pass keyword arguments on to the attention function"
        )
    if dropout:
        raise ValueError("attention dropout is not supported through the service (inference only)")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit softcapping is not supported by the service")
    if kwargs.get("is_causal") is False:
        raise NotImplementedError("the service attention is causal only")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError(
            "attention sinks (the s_aux / sinks argument) are not supported by the service"
        )
    for name in ("alibi", "position_bias", "attention_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attention with {name} is not supported by the service")
    window = kwargs.get("sliding_window")
    if window is not None:
        # A window at least as long as every sequence is plain causal attention.
        longest = max(r.start_position + r.count for r in step.plan.rows)
        if longest > window:
            raise NotImplementedError(
                f"sliding-window attention ({window}) over {longest} tokens is not supported "
                "by the service"
            )
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise RuntimeError(f"attention module {type(module).__name__} has no integer layer_idx")
    out = step.session.attend(step, layer, query, key, value, scaling)
    return out, None


class MissingStepError(RuntimeError):
    """The service attention ran without the step keyword the model's pre-hook injects."""


AttentionInterface.register(SERVICE_ATTENTION, service_attention_forward)


class ServiceModel:
    """A transformers causal LM whose attention layers use the service as KV cache.

    Args:
        model: a decoder-only ``PreTrainedModel`` whose attention layers go through
            transformers' ``AttentionInterface`` with an integer ``layer_idx`` (Llama,
            Mistral, Qwen2 and most Llama-family models).
        client: a connected ``KVCacheClient`` whose layout matches the model
            (layers, KV heads, head_dim).
        namespace: the service's prefix-cache namespace for this model's sequences. None
            (the default) derives it from the model (:func:`model_namespace`: config, name
            and a sample of every weight), so two different models of one layout never
            share cached prefixes while the same weights do, across processes.

    Construction refuses, before any forward through the service, a model whose attention
    the service does not compute exactly: features its config names (sinks, ALiBi, MLA,
    softcapping, recurrent/hybrid layers, non-causal attention) are refused by name; then a
    probe generates a few tokens for two random prompts with the model's own attention and
    through this integration against :class:`ExactAttentionService` (the service's
    arithmetic, locally), and refuses the model unless every layer attended once per step
    with the service's shapes and the logits agree.

    Raises:
        ValueError: the service layout does not fit the model, or the model's attention is
            not what the service computes (the message names the feature and the model).
    """

    def __init__(
        self, model: PreTrainedModel, client: ServiceClient, namespace: str | None = None
    ) -> None:
        what = describe_model(model)
        if namespace is not None and not isinstance(namespace, str):
            raise ValueError(f"namespace must be a str or None, got {type(namespace).__name__}")
        if model.config._attn_implementation == SERVICE_ATTENTION:
            raise ValueError("this model is already routed to the service (one ServiceModel each)")
        if model.dtype not in _DTYPES.values():
            raise ValueError(
                f"model dtype {model.dtype} cannot travel; use float16/bfloat16/float32"
            )
        features = unsupported_features(model)
        if features:
            raise ValueError(
                f"{what}: the service cannot compute this model's attention: " + "; ".join(features)
            )
        self.model = model
        self.client = client
        self.layout = model_layout(model)
        self.kv_dtype = _check_service_layout(client.info(), self.layout)
        self.span: AttentionSpan | None = attention_span(model)
        self.namespace = model_namespace(model) if namespace is None else namespace
        self._sessions: set[GenerationSession] = set()
        self._previous_attn = model.config._attn_implementation
        reference = self._probe_reference()
        try:
            model.set_attn_implementation(SERVICE_ATTENTION)
        except Exception as e:
            raise ValueError(
                f"{what}: transformers cannot route its attention to a registered attention "
                f"function ({type(e).__name__}: {e}); this model is not supported"
            ) from e
        self._pre_hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self._post_hook = model.register_forward_hook(
            self._after_forward, with_kwargs=True, always_call=True
        )
        try:
            self._probe_service_path(reference)
        except BaseException:
            self.detach()
            raise

    def check_span(self, prompt_tokens: int, new_tokens: int) -> None:
        """Refuse a request that could outgrow the model's smallest window/chunk.

        Args:
            prompt_tokens: the longest prompt of the batch, padding excluded.
            new_tokens: the most tokens generation may add to a row.

        Raises:
            ValueError: ``prompt_tokens + new_tokens`` exceeds the window/chunk.
        """
        if self.span is None or prompt_tokens + new_tokens <= self.span.size:
            return
        raise ValueError(
            f"{describe_model(self.model)} attends within a window/chunk of {self.span.size} "
            f"tokens ({self.span.source}); a prompt of {prompt_tokens} tokens plus up to "
            f"{new_tokens} new tokens ({prompt_tokens + new_tokens}) would exceed it, and the "
            "service computes full causal attention only (equal to the window only while "
            "every sequence fits in it)"
        )

    # --- the construction probe -------------------------------------------------------

    def _probe_batch(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        cfg = self.model.config.get_text_config(decoder=True)
        pad = self.model.generation_config.pad_token_id
        if not isinstance(pad, int):
            pad = 0
        length = PROBE_PROMPT
        if self.span is not None:
            # The probe must stay within the window, where full attention is exact.
            length = min(length, self.span.size - PROBE_NEW_TOKENS)
            if length < MIN_PROBE_PROMPT:
                raise ValueError(
                    f"{describe_model(self.model)}: its attention window/chunk of "
                    f"{self.span.size} tokens ({self.span.source}) is too small for the "
                    "service (it computes full causal attention only)"
                )
        ids, mask = probe_inputs(int(cfg.vocab_size), pad, length)
        device = self.model.device
        return ids.to(device), mask.to(device), probe_generation_config(self.model, pad)

    def _probe_reference(self) -> Any:
        """Generate the probe batch with the model's own attention and cache."""
        ids, mask, gc = self._probe_batch()
        try:
            with _eval_mode(self.model), torch.no_grad():
                batch = self.model.generate(
                    input_ids=ids, attention_mask=mask, generation_config=gc
                )
                pads = int((mask[1] == 0).sum())
                alone = self.model.generate(
                    input_ids=ids[1:, pads:], attention_mask=mask[1:, pads:], generation_config=gc
                )
        except Exception as e:
            raise ValueError(
                f"{describe_model(self.model)}: greedy generate() of a left-padded batch fails "
                f"with the model's own attention ({type(e).__name__}: {e}); the service "
                "integration needs a model that generate() runs"
            ) from e
        # A model whose output for a row depends on its left padding (positions counted
        # from the first column, not the first token) wrote a cached prefix at positions
        # that another request's padding would shift: such prefixes must not be adopted.
        tolerance = compare_generations(batch, batch, self.model.dtype).tolerance
        shift = float((batch.logits[0][1].float() - alone.logits[0][0].float()).abs().max())
        self.padding_moves_positions = not shift <= tolerance
        return batch

    def _probe_service_path(self, reference: Any) -> None:
        """Generate the probe batch through this integration with the service's arithmetic."""
        what = describe_model(self.model)
        ids, mask, gc = self._probe_batch()
        real_client = self.client
        stand_in = ExactAttentionService(self.kv_dtype)
        self.client = stand_in
        try:
            with _eval_mode(self.model), torch.no_grad():
                session = self.session(ids.cpu(), mask.cpu(), SessionConfig(reuse_prefix=False))
                with session:
                    ours = session.generate(generation_config=gc)
        except MissingStepError as e:
            raise ValueError(
                f"{what}: its decoder layers do not pass keyword arguments on to the attention "
                "function, so the service cannot tell its layers which sequences and step they "
                "belong to; this model is not supported"
            ) from e
        except NotImplementedError as e:
            raise ValueError(f"{what}: the service cannot compute its attention: {e}") from e
        except Exception as e:
            raise ValueError(
                f"{what}: its attention does not go through the service as required "
                f"(exactly once per layer 0..{self.layout.num_layers - 1} per step, through "
                f"transformers' AttentionInterface, with {self.layout.num_q_heads} query / "
                f"{self.layout.num_kv_heads} KV heads of {self.layout.head_dim} channels): "
                f"{type(e).__name__}: {e}"
            ) from e
        finally:
            self.client = real_client
        result = compare_generations(ours, reference, self.model.dtype)
        if result.step is not None:
            raise ValueError(
                f"{what}: its attention is not the plain causal softmax attention the service "
                "computes (scale head_dim**-0.5, contiguous GQA groups, no bias/sinks/window/"
                f"softcap): a probe generation's logits differ by {result.worst:.3g} "
                f"(tolerance {result.tolerance:.3g}) at step {result.step}; this model is not "
                "supported"
            )

    def session(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        config: SessionConfig | None = None,
    ) -> GenerationSession:
        """Open a session: one service sequence per row of a left-padded batch.

        Args:
            input_ids: int ``[batch, columns]``, rows left-padded.
            attention_mask: 0/1 ``[batch, columns]`` (0 = padding); None = no padding.
            config: see :class:`SessionConfig`.
        """
        config = config or SessionConfig()
        if self.padding_moves_positions and config.reuse_prefix:
            # Its cached prefixes hold K/V at positions that depend on the padding they were
            # written with: start every sequence empty instead.
            config = dataclasses.replace(config, reuse_prefix=False)
        s = GenerationSession(self, input_ids, attention_mask, config)
        self._sessions.add(s)
        return s

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        config: SessionConfig | None = None,
        **generate_kwargs: Any,
    ) -> tuple[Any, SessionStats]:
        """Open a session, ``generate()`` through it, close it.

        Returns:
            (what ``model.generate`` returned, the session's :class:`SessionStats`).
        """
        mask = _normalise_mask(attention_mask, input_ids.shape)
        defaults = generate_kwargs.get("generation_config") or self.model.generation_config
        columns = int(input_ids.shape[1])
        probe_plan = BatchPlan(_left_padding(mask), [0] * input_ids.shape[0], columns)
        self.check_span(
            int(mask.sum(dim=1).max()), _new_tokens(generate_kwargs, defaults, probe_plan)
        )
        with self.session(input_ids, attention_mask, config) as s:
            out = s.generate(**generate_kwargs)
        return out, s.stats

    def detach(self) -> None:
        """Close open sessions, remove the hooks and restore the model's attention."""
        for s in list(self._sessions):
            s.close()
        self._pre_hook.remove()
        self._post_hook.remove()
        self.model.set_attn_implementation(self._previous_attn)

    def _before_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        cache = kwargs.get("past_key_values")
        if not isinstance(cache, ServiceKVCache) or cache.session._owner is not self:
            raise ValueError(
                "this model's attention runs in the service: pass past_key_values=session.cache "
                "of a session opened with ServiceModel.session() (or use its generate())"
            )
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError("input_ids are required: the service indexes the cache by token id")
        step, positions = cache.session.begin_step(
            input_ids, kwargs.get("attention_mask"), kwargs.get("position_ids")
        )
        kwargs = dict(kwargs)
        kwargs[_STEP_KWARG] = step
        kwargs["position_ids"] = positions.to(input_ids.device)
        # The session checked the mask; the attention ignores it, so skip building one.
        kwargs["attention_mask"] = None
        return args, kwargs

    def _after_forward(
        self,
        module: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> None:
        step = kwargs.get(_STEP_KWARG)
        if isinstance(step, _ActiveStep):  # absent when the pre-hook itself raised
            # torch passes output=None when the forward raised.
            step.session.end_step(step, failed=output is None)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run the probe without dropout; restore the model's training flag afterwards."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def _check_service_layout(info: Any, layout: ModelLayout) -> torch.dtype:
    """Compare the service's layout (``client.info()``) with the model's; return its KV dtype."""
    svc = getattr(info, "layout", info)
    mismatches = [
        f"{name}: service {getattr(svc, name, None)} != model {want}"
        for name, want in (
            ("num_layers", layout.num_layers),
            ("num_kv_heads", layout.num_kv_heads),
            ("head_dim", layout.head_dim),
        )
        if getattr(svc, name, None) != want
    ]
    if mismatches:
        raise ValueError("the service layout does not fit the model: " + "; ".join(mismatches))
    dtype = getattr(svc, "dtype", None)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown service KV dtype {dtype!r}")
    return _DTYPES[dtype]
