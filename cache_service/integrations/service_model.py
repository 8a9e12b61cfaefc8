"""A transformers causal LM whose attention layers use the service as KV cache.

:class:`ServiceModel` refuses a model whose attention the service does not compute exactly
(by config features, then by a probe generation against the service's arithmetic), routes
every attention layer to :func:`service_attention_forward` and installs the forward hooks
that open and close each :class:`GenerationSession` step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import PreTrainedModel

from cache_service.client import AppendAttendItem
from cache_service.integrations.batch_plan import BatchPlan
from cache_service.integrations.generation_session import (
    GenerationSession,
    SessionConfig,
    SessionStats,
    left_padding,
    new_tokens,
    normalise_mask,
)
from cache_service.integrations.model_features import (
    AttentionSpan,
    attention_span,
    describe_model,
    unsupported_features,
)
from cache_service.integrations.model_layout import (
    KV_DTYPES,
    check_service_layout,
    model_layout,
    model_namespace,
)
from cache_service.integrations.model_probe import (
    MIN_PROBE_PROMPT,
    PROBE_NEW_TOKENS,
    PROBE_PROMPT,
    ExactAttentionService,
    compare_generations,
    probe_generation_config,
    probe_inputs,
    rounding_noise,
)
from cache_service.integrations.service_attention import (
    SERVICE_ATTENTION,
    STEP_KWARG,
    ActiveStep,
    MissingStepError,
)
from cache_service.integrations.service_cache import ServiceKVCache
from cache_service.integrations.step_leases import StepLeaser

if TYPE_CHECKING:
    from cache_service.client import SequenceHandle


class ServiceClient(Protocol):
    """What the adapter needs of ``cache_service.client.KVCacheClient``."""

    def info(self) -> Any: ...

    def create_sequence(
        self, prompt_token_ids: Sequence[int] | None = None, *, namespace: str = ""
    ) -> SequenceHandle: ...

    def create_sequences(
        self, prompts: Sequence[Sequence[int] | None], *, namespace: str = ""
    ) -> list[SequenceHandle]: ...

    def free(self, seq_id: str) -> None: ...

    def free_sequences(self, seq_ids: Sequence[str]) -> None: ...

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
    with the service's shapes and the logits agree (within the dtype's tolerance, or twice
    what the model's own sdpa and eager attention differ by: `model_probe.rounding_noise`).

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
        if model.dtype not in KV_DTYPES.values():
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
        self.kv_dtype = check_service_layout(client.info(), self.layout)
        self.span: AttentionSpan | None = attention_span(model)
        self.namespace = model_namespace(model) if namespace is None else namespace
        # Step leases of this model's sessions (a forward's later layers to the worker).
        self.leaser = StepLeaser(client, self.layout.num_q_heads)
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
        self._probe_noise = self._rounding_noise(ids, mask, gc, batch)
        # A model whose output for a row depends on its left padding (positions counted
        # from the first column, not the first token) wrote a cached prefix at positions
        # that another request's padding would shift: such prefixes must not be adopted.
        tolerance = compare_generations(batch, batch, self.model.dtype, self._probe_noise).tolerance
        shift = float((batch.logits[0][1].float() - alone.logits[0][0].float()).abs().max())
        self.padding_moves_positions = not shift <= tolerance
        return batch

    def _rounding_noise(
        self, ids: torch.Tensor, mask: torch.Tensor, gc: Any, reference: Any
    ) -> float:
        """How much the probe's logits move when the model's own attention is computed by
        its other implementation (eager for sdpa and the rest, sdpa for eager): the
        rounding noise the service path's comparison allows for. 0 when the model has no
        other implementation."""
        other = "sdpa" if self._previous_attn == "eager" else "eager"
        try:
            self.model.set_attn_implementation(other)
            with _eval_mode(self.model), torch.no_grad():
                alternative = self.model.generate(
                    input_ids=ids, attention_mask=mask, generation_config=gc
                )
        except Exception:  # no such implementation for this model: the dtype's tolerance
            return 0.0
        finally:
            self.model.set_attn_implementation(self._previous_attn)
        return rounding_noise(reference, alternative)

    def _probe_service_path(self, reference: Any) -> None:
        """Generate the probe batch through this integration with the service's arithmetic."""
        what = describe_model(self.model)
        ids, mask, gc = self._probe_batch()
        real_client = self.client
        stand_in = ExactAttentionService(self.kv_dtype)
        self.client = stand_in
        try:
            with _eval_mode(self.model), torch.no_grad():
                session = self.session(
                    ids.cpu(), mask.cpu(), SessionConfig(reuse_prefix=False, step_leases=False)
                )
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
        result = compare_generations(ours, reference, self.model.dtype, self._probe_noise)
        if result.step is not None:
            raise ValueError(
                f"{what}: its attention is not the plain causal softmax attention the service "
                "computes (scale head_dim**-0.5, contiguous GQA groups, no bias/sinks/window/"
                f"softcap): a probe generation's logits differ by {result.worst:.3g} "
                f"(tolerance {result.tolerance:.3g}; the model's own sdpa and eager attention "
                f"differ by {self._probe_noise:.3g}) at step {result.step}; this model is not "
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
        mask = normalise_mask(attention_mask, input_ids.shape)
        defaults = generate_kwargs.get("generation_config") or self.model.generation_config
        columns = int(input_ids.shape[1])
        probe_plan = BatchPlan(left_padding(mask), [0] * input_ids.shape[0], columns)
        self.check_span(
            int(mask.sum(dim=1).max()), new_tokens(generate_kwargs, defaults, probe_plan)
        )
        with self.session(input_ids, attention_mask, config) as s:
            out = s.generate(**generate_kwargs)
        return out, s.stats

    def detach(self) -> None:
        """Close open sessions, remove the hooks and restore the model's attention."""
        for s in list(self._sessions):
            s.close()
        self.leaser.close()
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
        kwargs[STEP_KWARG] = step
        if positions is not None:
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
        step = kwargs.get(STEP_KWARG)
        if isinstance(step, ActiveStep):  # absent when the pre-hook itself raised
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
