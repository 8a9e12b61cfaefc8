"""One generation request through the service: a left-padded batch of service sequences.

:class:`GenerationSession` owns one service sequence per batch row. Per forward it checks
the step's inputs against the session and plans which columns each row sends
(:meth:`~GenerationSession.begin_step`), sends each layer's new keys/values and queries in
one RPC (:meth:`~GenerationSession.attend`) and commits the step once every layer attended
(:meth:`~GenerationSession.end_step`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cache_service.client import AppendAttendItem, DataLossError, NotFoundError
from cache_service.integrations.batch_plan import BatchPlan, RowSlice, StepPlan
from cache_service.integrations.host_inputs import InputReader
from cache_service.integrations.model_features import describe_model
from cache_service.integrations.service_attention import SERVICE_ATTENTION, ActiveStep
from cache_service.integrations.service_cache import ServiceKVCache
from cache_service.integrations.step_leases import ActiveLease

if TYPE_CHECKING:
    from cache_service.client import SequenceHandle
    from cache_service.integrations.service_model import ServiceModel


@dataclass(frozen=True)
class SessionConfig:
    """How a :class:`GenerationSession` uses the service.

    Attributes:
        reuse_prefix: create each sequence with its prompt so the service adopts the longest
            cached prefix (the prefill then computes only the rest). False starts every
            sequence empty.
        free_on_close: free the sequences when the session closes. Their full blocks stay
            in the service's prefix cache either way.
        step_leases: when the service runs on this host (a local session), have the
            service plan forwards (see `lease_steps`) and send their layers straight to
            the worker under a step lease (`integrations.step_leases`); off: every layer
            is a call.
        lease_steps: decode forwards one step lease covers (the service may grant
            fewer): the service reserves the rows' next positions for all of them at
            once and the session plans the forwards between itself, naming their tokens
            when the lease ends. Between the forwards of one ``generate()`` the session
            holds the lease: :meth:`GenerationSession.generate` and
            :meth:`GenerationSession.close` give it back, and so does
            :meth:`GenerationSession.release_lease` (call it after a ``generate()`` of
            your own before other calls on the session's sequences). 1: a lease per
            forward.
    """

    reuse_prefix: bool = True
    free_on_close: bool = True
    step_leases: bool = True
    lease_steps: int = 16

    def __post_init__(self) -> None:
        if type(self.lease_steps) is not int or self.lease_steps < 1:
            raise ValueError(f"lease_steps must be a positive int, got {self.lease_steps!r}")


@dataclass
class SessionStats:
    """What a session sent to the service (counts are per layer: every layer sends the same).

    Attributes:
        cached_tokens: per row, prompt tokens the service already held at creation.
        prompt_tokens: per row, prompt length without padding.
        step_columns: per forward, columns the model computed.
        step_tokens: per forward, tokens sent to the service for each row.
        rpc_calls: append-and-attend calls (one per layer per forward, less the leased ones).
        rpc_seconds: wall time spent inside them (the client call), seconds.
        leased_calls: layers sent to the worker under a step lease (no call).
        leased_seconds: wall time spent sending them (the staging copies' launches and the
            worker's handoff; on a GPU not the kernels, which run asynchronously), seconds.
        leases: step leases the service granted (one StepLease call each; a lease covers
            up to `SessionConfig.lease_steps` decode forwards).
        lease_forwards: forwards whose every layer ran under a step lease.
        lease_seconds: wall time of those calls, seconds.
        attend_seconds: wall time of the attention layers' whole service path (checks, the
            tensors' moves to and from the host, the client call, the step lease's
            request), seconds; minus ``rpc_seconds``, ``leased_seconds`` and
            ``lease_seconds``: what the integration itself costs.
        open_seconds: wall time of creating the rows' sequences (one CreateSequences
            call), seconds.
        close_seconds: wall time of freeing them when the session closed (one
            FreeSequences call; 0 until then, or when the config keeps them), seconds.
    """

    cached_tokens: list[int]
    prompt_tokens: list[int]
    step_columns: list[int] = field(default_factory=list)
    step_tokens: list[list[int]] = field(default_factory=list)
    rpc_calls: int = 0
    rpc_seconds: float = 0.0
    leased_calls: int = 0
    leased_seconds: float = 0.0
    leases: int = 0
    lease_forwards: int = 0
    lease_seconds: float = 0.0
    attend_seconds: float = 0.0
    open_seconds: float = 0.0
    close_seconds: float = 0.0

    @property
    def prefill_tokens(self) -> list[int]:
        """Per row, tokens the first forward (the prefill) sent."""
        return list(self.step_tokens[0]) if self.step_tokens else []


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
        mask = normalise_mask(attention_mask, input_ids.shape)
        pads = left_padding(mask)
        self._owner = owner
        self._config = config
        self.input_ids = input_ids.detach().cpu()
        self.attention_mask = mask
        prompts = [self.input_ids[b, pads[b] :].tolist() for b in range(len(pads))]
        owner.check_span(max(len(p) for p in prompts), 0)
        self._handles: list[SequenceHandle] = []
        self._closed = False
        self._broken: str | None = None
        self._active: ActiveStep | None = None
        # A step lease with decode steps left, kept between forwards (`end_step`).
        self._held: ActiveLease | None = None
        self._reader = InputReader()
        # One call for the batch's rows, all or nothing: nothing to free when it fails.
        t_open = time.perf_counter()
        self._handles = owner.client.create_sequences(
            [p if config.reuse_prefix else None for p in prompts], namespace=owner.namespace
        )
        opened = time.perf_counter() - t_open
        cached = [int(h.num_cached_tokens) for h in self._handles]
        self._seq_ids = [h.seq_id for h in self._handles]
        self.plan = BatchPlan(pads, cached, int(input_ids.shape[1]))
        self.stats = SessionStats(
            cached_tokens=cached, prompt_tokens=[len(p) for p in prompts], open_seconds=opened
        )
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
            max(self.stats.prompt_tokens), new_tokens(generate_kwargs, defaults, self.plan)
        )
        device = self._owner.model.device
        try:
            out = self._owner.model.generate(
                input_ids=self.input_ids.to(device),
                attention_mask=self.attention_mask.to(device),
                past_key_values=self.cache,
                use_cache=True,
                **generate_kwargs,
            )
        except BaseException as exc:
            try:
                self.release_lease()
            except Exception as release_error:  # the generation's error matters more
                exc.add_note(f"giving back the session's step lease also failed: {release_error!r}")
            raise
        # The last forwards' lease: what they wrote is committed now (and a layer refused
        # in the last of them raises here).
        self.release_lease()
        return out

    def release_lease(self) -> None:
        """Give back the step lease the session holds between forwards, if any: the
        service commits the steps it ran and frees the positions reserved for later
        ones. Until then the session's sequences are held (another call on one of them
        waits for the lease's timeout). Idempotent.

        Raises:
            KVCacheError: the lease's report failed (the session is unusable then).
        """
        held, self._held = self._held, None
        if held is None:
            return
        try:
            self._owner.leaser.end(held)
        except BaseException:
            self._broken = "the session's step lease did not end cleanly"
            raise

    def close(self) -> None:
        """Give back the session's step lease, then free the sequences (if the config
        says so). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._owner._sessions.discard(self)
        try:
            self.release_lease()
        except Exception:
            # The sequences are freed next: what the lease wrote no longer matters.
            if not self._config.free_on_close:
                raise
        if self._config.free_on_close:
            t_close = time.perf_counter()
            try:
                self._free_all(suppress=False)
            finally:
                self.stats.close_seconds = time.perf_counter() - t_close

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
    ) -> tuple[ActiveStep, torch.Tensor | None]:
        """Check a forward's inputs against the session and plan what each row sends.

        Args:
            input_ids: int ``[batch, q]``, columns ``[consumed, consumed + q)`` of the batch.
            attention_mask: 0/1 ``[batch, consumed + q]`` or None.
            position_ids: int ``[batch or 1, q]`` or None.

        Returns:
            (the step, the position ids ``[batch, q]`` the model must use, or None when
            `position_ids` are those already).
        """
        if self._active is not None:
            # The last forward never reported its end (a hook failed before the model ran).
            self._drop_lease_request(self._active)
            if self._active.lease is not None and self._active.lease is not self._held:
                with contextlib.suppress(Exception):
                    self._owner.leaser.end(self._active.lease)
        self._check_usable()
        plan = self.plan
        if input_ids.ndim != 2 or input_ids.shape[0] != plan.batch_size:
            raise ValueError(
                f"input_ids must be [{plan.batch_size}, q] for this session, got {tuple(input_ids.shape)}"
            )
        q = int(input_ids.shape[1])
        start = plan.consumed
        if attention_mask is not None:
            self._check_mask_shape(attention_mask, start, q)
        # The forward's inputs on the host (on a GPU one wait, not three).
        ids, new_mask, given_positions = self._reader.read(
            input_ids,
            attention_mask[:, start:] if attention_mask is not None else None,
            position_ids,
        )
        if start < plan.prompt_columns:
            stop = min(start + q, plan.prompt_columns)
            if not torch.equal(ids[:, : stop - start], self.input_ids[:, start:stop]):
                raise ValueError(
                    f"input_ids columns {start}..{stop} differ from the session's prompt; "
                    "open a new session for another prompt"
                )
        decoding = q == 1 and start >= plan.prompt_columns
        # A decode step's new mask column is all ones (no row pads after its prompt).
        if new_mask is not None and not (decoding and bool(new_mask.all())):
            self._check_new_mask(new_mask, start, q)
        step = plan.plan(q)
        span = self._owner.span
        if (
            span is not None
            and (longest := max(r.start_position + r.count for r in step.rows)) > span.size
        ):
            raise NotImplementedError(
                f"{describe_model(self._owner.model)} limits attention to {span.size} tokens "
                f"({span.source}); this step would make a sequence {longest} tokens long, "
                "and the service computes full causal attention only"
            )
        fast = _decode_inputs(step, ids, given_positions) if decoding else None
        if fast is not None:
            token_ids, expected_positions = fast
        else:
            token_ids, expected_positions = self._step_inputs(step, ids, given_positions)
        active = self._active = ActiveStep(self, step, token_ids)
        sending = active.sending
        t_lease = time.perf_counter()
        decode = len(sending) == plan.batch_size and all(r.count == 1 for r in sending)
        held, self._held = self._held, None
        if held is not None:
            # The lease of the last forwards goes on to this one if it has a step left
            # (a decode step of the same rows); else it ends here.
            leaser = self._owner.leaser
            try:
                if decode and leaser.next_step(held, [token_ids[r.row][0] for r in sending]):
                    active.lease = held
                else:
                    leaser.end(held)
            except BaseException:
                self._active = None
                self._broken = f"the step lease kept for step {step.index} failed"
                raise
        if active.lease is None and sending and self._config.step_leases:
            # The service plans the step while the model computes up to its first
            # attention layer, which reads the lease (none: each layer is a call).
            active.lease_request = self._owner.leaser.request(
                [self._seq_ids[r.row] for r in sending],
                [token_ids[r.row] for r in sending],
                self._config.lease_steps if decode else 1,
            )
        elapsed = time.perf_counter() - t_lease
        self.stats.lease_seconds += elapsed
        self.stats.attend_seconds += elapsed
        return active, expected_positions

    def _step_inputs(
        self, step: StepPlan, ids: torch.Tensor, given_positions: torch.Tensor | None
    ) -> tuple[list[list[int]], torch.Tensor]:
        """Any step's new token ids per row and the position ids ``[batch, q]`` the model
        must use, checking the positions it was given (`begin_step`).

        Raises:
            ValueError: position ids other than the service's.
        """
        batch, q = ids.shape
        start = step.start_column
        # Whole-batch tensor ops rather than a few per row: at batch 32 the per-row ones
        # cost more host time than the forward's attention launches.
        rows = [row.row for row in step.rows]
        offsets = [row.first_column - start for row in step.rows]
        columns = torch.arange(q)
        shift = torch.tensor([row.first_column - start - row.start_position for row in step.rows])
        expected_positions = torch.zeros(batch, q, dtype=torch.long)
        expected_positions[rows] = columns - shift[:, None]
        id_rows = ids.tolist()
        token_ids = [id_rows[r][o:] for r, o in zip(rows, offsets, strict=True)]
        if given_positions is not None:
            given = given_positions.expand(batch, q)
            sent = columns >= torch.tensor(offsets)[:, None]
            wrong = ((given[rows] != expected_positions[rows]) & sent).any(dim=1)
            for i in wrong.nonzero().flatten().tolist():
                row, offset = step.rows[i], offsets[i]
                raise ValueError(
                    f"row {row.row}: position_ids {given[row.row, offset:].tolist()} do not "
                    f"match the service positions starting at {row.start_position}"
                )
        # Padding columns come out negative: any position will do there (nothing reads them).
        return token_ids, expected_positions.clamp_min(0)

    def end_step(self, step: ActiveStep, failed: bool) -> None:
        """Commit a finished forward; a forward that failed or skipped layers breaks the session."""
        self._active = None
        self._drop_lease_request(step)
        if step.lease is not None:
            # Also after a failure: the service commits the layers the lease wrote.
            try:
                if not failed and self._owner.leaser.keeps(step.lease):
                    self._held = step.lease  # its next step is the next forward's
                else:
                    self._owner.leaser.end(step.lease)
            except BaseException:
                self._broken = f"the lease of step {step.plan.index} did not end cleanly"
                if not failed:
                    raise
        num_layers = self._owner.layout.num_layers
        # `_check_attend` admits only the layout's layers, once each: a count tells.
        missing = (
            set(range(num_layers)) - step.layers_done if len(step.layers_done) != num_layers else ()
        )
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
        self.stats.lease_forwards += step.lease is not None
        self.stats.step_columns.append(step.plan.num_columns)
        self.stats.step_tokens.append([r.count for r in step.plan.rows])

    def attend(
        self,
        step: ActiveStep,
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
        t0 = time.perf_counter()
        self._check_attend(step, layer, query, key, value)
        batch, num_q_heads, q, head_dim = query.shape
        rows, width = step.sending, step.width
        factor = _query_factor(scaling, head_dim)
        if step.lease_request is not None:
            # The step's lease, planned by the service since the forward began: every
            # layer goes to the worker under it.
            t_lease = time.perf_counter()
            requested, step.lease_request = step.lease_request, None
            step.lease = self._owner.leaser.granted(requested)
            self.stats.leases += step.lease is not None
            self.stats.lease_seconds += time.perf_counter() - t_lease
        if step.lease is not None and layer in step.lease.layers:
            out = self._leased(step, layer, rows, query, key, value, factor)
            if out is not None:
                self.stats.attend_seconds += time.perf_counter() - t0
                return out
        # One device-to-host copy per tensor per layer (the client sends CPU bytes), not one
        # per row; K/V go in the service's KV dtype, queries in the model's (the output
        # comes back in the query's dtype).
        kv_dtype = self._owner.kv_dtype
        q_host = query[:, :, q - width :, :].transpose(1, 2).to("cpu")
        k_host = key[:, :, q - width :, :].transpose(1, 2).to("cpu", kv_dtype)
        v_host = value[:, :, q - width :, :].transpose(1, 2).to("cpu", kv_dtype)
        if factor is not None:
            q_host = q_host * factor
        outputs = self._append_attend(step, layer, rows, width, k_host, v_host, q_host)
        if isinstance(outputs, torch.Tensor):  # every row sent `width` tokens: [batch, width, ...]
            if tuple(outputs.shape) != (batch, width, num_q_heads, head_dim):
                raise RuntimeError(
                    f"service output has shape {tuple(outputs.shape)}, "
                    f"expected {(batch, width, num_q_heads, head_dim)}"
                )
            out = outputs.to(query.dtype) if width == q else _right_aligned(outputs, q, query.dtype)
        else:
            out = self._scatter_rows(rows, outputs, q, query.dtype)
        step.layers_done.add(layer)
        out = out.to(query.device)
        self.stats.attend_seconds += time.perf_counter() - t0
        return out

    def _leased(
        self,
        step: ActiveStep,
        layer: int,
        rows: list[RowSlice],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        factor: float | None,
    ) -> torch.Tensor | None:
        """One layer under the step's lease, on the model's device: ``[batch, q, q_heads,
        head_dim]`` as `attend` returns it; None: the lease ended, send the layer as a
        call."""
        t0 = time.perf_counter()
        q = query.shape[2]
        q4, k4, v4 = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        uniform = step.uniform and step.width == q
        if not uniform:
            # Rows sending different columns (a ragged prefill): each row's last columns,
            # sequence by sequence.
            q4, k4, v4 = (torch.cat([t[r.row, q - r.count :] for r in rows]) for t in (q4, k4, v4))
        if factor is not None:
            q4 = q4 * factor
        assert step.lease is not None
        try:
            out = self._owner.leaser.run(step.lease, layer, k4, v4, q4)
        except BaseException:
            self._broken = f"leased layer {layer} of step {step.plan.index} failed"
            raise
        if out is None:
            step.lease = None
            return None
        if not uniform:
            parts = list(out.split([r.count for r in rows]))
            out = self._scatter_rows(rows, parts, q, out.dtype, out.device)
        step.layers_done.add(layer)
        self.stats.leased_calls += 1
        self.stats.leased_seconds += time.perf_counter() - t0
        return out if out.dtype == query.dtype else out.to(query.dtype)

    # --- helpers ------------------------------------------------------------------------

    def _drop_lease_request(self, step: ActiveStep) -> None:
        """Read the answer of `step`'s lease request if no layer did (its forward failed
        before one, or never reached the model): that frees the local session for the
        next call; the lease itself ends at that call, reporting nothing written when its
        grant opened it for this process."""
        if step.lease_request is not None:
            requested, step.lease_request = step.lease_request, None
            with contextlib.suppress(Exception):
                lease = self._owner.leaser.granted(requested)
                if lease is not None:
                    self._owner.leaser.end(lease)

    def _check_attend(
        self,
        step: ActiveStep,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> None:
        """Refuse an attention call outside the current step, repeated, or of the wrong shape."""
        if step is not self._active:
            raise RuntimeError("attention called outside the session's current forward step")
        if layer in step.layers_done:
            raise RuntimeError(f"layer {layer} attended twice in one forward step")
        layout = self._owner.layout
        if not 0 <= layer < layout.num_layers:
            raise ValueError(
                f"attention layer_idx {layer} is outside the model's {layout.num_layers} layers"
            )
        _, num_q_heads, q, head_dim = query.shape
        if (num_q_heads, head_dim, tuple(key.shape[1:])) != (
            layout.num_q_heads,
            layout.head_dim,
            (layout.num_kv_heads, q, head_dim),
        ) or tuple(value.shape) != tuple(key.shape):
            raise ValueError(
                f"layer {layer}: query {tuple(query.shape)} / key {tuple(key.shape)} do not "
                f"match the model layout {layout}"
            )

    def _scatter_rows(
        self,
        rows: list[RowSlice],
        outputs: list[torch.Tensor],
        q: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """``[batch, q, q_heads, head_dim]`` of the rows' outputs, right-aligned, on
        `device` (None: the host); zeros where a row sent nothing."""
        layout = self._owner.layout
        if len(outputs) != len(rows):
            raise RuntimeError(f"service returned {len(outputs)} outputs for {len(rows)} rows")
        batch = self.plan.batch_size
        out = torch.zeros(batch, q, layout.num_q_heads, layout.head_dim, dtype=dtype, device=device)
        for r, o in zip(rows, outputs, strict=True):
            if tuple(o.shape) != (r.count, layout.num_q_heads, layout.head_dim):
                raise RuntimeError(
                    f"service output for row {r.row} has shape {tuple(o.shape)}, "
                    f"expected {(r.count, layout.num_q_heads, layout.head_dim)}"
                )
            out[r.row, q - r.count :] = o
        return out

    def _append_attend(
        self,
        step: ActiveStep,
        layer: int,
        rows: list[RowSlice],
        width: int,
        k_host: torch.Tensor,
        v_host: torch.Tensor,
        q_host: torch.Tensor,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Send the rows' new K/V and queries of one layer in one RPC.

        Returns ``[batch, width, q_heads, head_dim]`` when every row sent ``width`` tokens
        (the batch call), else one ``[count, q_heads, head_dim]`` output per sending row.

        ``k_host``/``v_host``/``q_host`` are ``[batch, width, heads, head_dim]`` on the host,
        right-aligned: row ``r`` sends its last ``r.count`` of the ``width`` columns. A
        failed call breaks the session (some layers may have written and others not).
        """
        batch = k_host.shape[0]
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
                outputs: torch.Tensor | list[torch.Tensor] = stacked
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
        return outputs

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

    def _check_mask_shape(self, attention_mask: torch.Tensor, start: int, q: int) -> None:
        if attention_mask.ndim != 2:
            raise ValueError(
                f"only 2D 0/1 attention masks are supported, got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask.shape != (self.plan.batch_size, start + q):
            raise ValueError(
                f"attention_mask must be [{self.plan.batch_size}, {start + q}] at this step, "
                f"got {tuple(attention_mask.shape)}"
            )

    def _check_new_mask(self, new_mask: torch.Tensor, start: int, q: int) -> None:
        """The attention mask's columns of this step (host, `[batch, q]`) as the session
        expects them."""
        want = torch.tensor(self.plan.expected_mask(start, start + q), dtype=torch.long)
        if not torch.equal(new_mask.to(torch.long), want):
            raise ValueError(
                "attention_mask must keep the session's left padding and mark every new "
                f"column as a token (columns {start}..{start + q})"
            )

    def _free_all(self, suppress: bool) -> None:
        """Free every sequence, in one call; raise its failure unless suppress."""
        handles, self._handles = self._handles, []
        if not handles:
            return
        client = self._owner.client
        try:
            client.free_sequences([h.seq_id for h in handles])
            return
        except (NotFoundError, DataLossError):
            # One was gone already (freed elsewhere, or lost with a worker: the batch call
            # freed nothing): each of the others on its own.
            pass
        except Exception as exc:
            if suppress:
                return
            raise RuntimeError(f"freeing the session's sequences failed: {exc!r}") from exc
        errors = []
        for handle in handles:
            try:
                client.free(handle.seq_id)
            except (NotFoundError, DataLossError):
                pass
            except Exception as exc:
                errors.append(exc)
        if errors and not suppress:
            raise RuntimeError(
                f"freeing {len(errors)} sequence(s) failed: {errors[0]!r}"
            ) from errors[0]


@functools.lru_cache(maxsize=64)
def _query_factor(scaling: float | None, head_dim: int) -> float | None:
    """What the query is multiplied by for the model's softmax scale `scaling` (None: its
    default): the service applies ``head_dim ** -0.5``, another scale is folded into the
    query. None when the two agree (cached: it is asked once per layer)."""
    factor = 1.0 if scaling is None else scaling * math.sqrt(head_dim)
    return None if math.isclose(factor, 1.0, rel_tol=1e-6) else factor


def _decode_inputs(
    step: StepPlan, ids: torch.Tensor, given_positions: torch.Tensor | None
) -> tuple[list[list[int]], torch.Tensor | None] | None:
    """`GenerationSession._step_inputs` of a decode step whose every row sends its one
    column, in a few whole-batch operations, with None for positions when the model was
    given the service's (it keeps its own, on its device: no copy back); None when the
    step is not one, or its position ids are wrong (the general path then says which)."""
    if any(r.count != 1 for r in step.rows):
        return None
    starts = [r.start_position for r in step.rows]
    if given_positions is None:
        return ids.tolist(), torch.tensor(starts).view(-1, 1)
    if given_positions.numel() != len(starts) or given_positions.reshape(-1).tolist() != starts:
        return None
    return ids.tolist(), None


def _right_aligned(outputs: torch.Tensor, q: int, dtype: torch.dtype) -> torch.Tensor:
    """``[batch, q, ...]`` holding ``outputs`` ``[batch, width, ...]`` in its last columns."""
    out = torch.zeros(outputs.shape[0], q, *outputs.shape[2:], dtype=dtype)
    out[:, q - outputs.shape[1] :] = outputs
    return out


def new_tokens(generate_kwargs: dict[str, Any], defaults: Any, plan: BatchPlan) -> int:
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


def normalise_mask(attention_mask: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
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


def left_padding(mask: torch.Tensor) -> list[int]:
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
