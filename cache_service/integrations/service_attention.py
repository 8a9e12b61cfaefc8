"""The attention function transformers calls for a model routed to the service.

:func:`service_attention_forward` is registered in transformers' ``AttentionInterface`` as
:data:`SERVICE_ATTENTION`. The model's forward pre-hook passes each attention layer the
:class:`ActiveStep` under the :data:`STEP_KWARG` keyword; the function refuses attention
variants the service does not compute, then hands the layer to the step's session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface

from cache_service.integrations.batch_plan import StepPlan

if TYPE_CHECKING:
    from cache_service.integrations.generation_session import GenerationSession
    from cache_service.integrations.step_leases import ActiveLease, LeaseRequest

SERVICE_ATTENTION = "kvcache_service"
"""The ``attn_implementation`` name under which the service attention is registered."""

# Forward keyword carrying the active step from the model's pre-hook down to each attention
# layer (transformers forwards unknown keywords to the attention function).
STEP_KWARG = "kvcache_step"


class ActiveStep:
    """One forward pass in flight: the plan, its token ids, and which layers have attended."""

    def __init__(self, session: GenerationSession, plan: StepPlan, token_ids: list[list[int]]):
        self.session = session
        self.plan = plan
        self.token_ids = token_ids  # per row: the ids of the tokens it sends this step
        self.layers_done: set[int] = set()
        # The step's lease request, sent when the forward began, and its lease once the
        # first layer read the answer (integrations.step_leases).
        self.lease_request: LeaseRequest | None = None
        self.lease: ActiveLease | None = None
        # The rows sending tokens, the most any sends, and whether every row sends the
        # step's every column: the same for each layer, so worked out once.
        self.sending = [r for r in plan.rows if r.count]
        self.width = max((r.count for r in self.sending), default=0)
        self.uniform = len(self.sending) == len(plan.rows) and all(
            r.count == self.width for r in self.sending
        )


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
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, ActiveStep):
        raise MissingStepError(
            f"attention {SERVICE_ATTENTION!r} of {type(module).__name__} received no service "
            f"step (the {STEP_KWARG!r} keyword): either the model was not called through "
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
