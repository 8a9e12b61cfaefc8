"""Batch replies written into a client's shared-memory region (the requests' `output_to` /
`lse_to`): checked before the coordinator runs, written only after it succeeded.

`shared_outputs` reads the two fields of an AppendAttendBatchRequest / AttendBatchRequest
and reserves their ranges (`SharedRegions.check_writable`), so a bad range fails the call
with INVALID_ARGUMENT naming the field before the cache changes; `SharedOutputs.reply`
writes the outputs and encodes the reply, whose tensors then carry the slices instead of
bytes. The servicer holds the object in a `with` block around the coordinator call: the
regions stay mapped until the call ends, whatever a concurrent release does.
"""

from __future__ import annotations

from typing import Any

import torch

from cache_service.api.result_codec import encode_batch_result
from cache_service.errors import InvalidRequest
from cache_service.wire.shared_regions import OutputSlot, SharedRegions

__all__ = ["SharedOutputs", "batch_reply", "shared_outputs"]


class SharedOutputs:
    """The reply's output and lse slots (None: that tensor travels as bytes)."""

    __slots__ = ("lse", "out")

    def __init__(self, out: OutputSlot | None, lse: OutputSlot | None) -> None:
        self.out = out
        self.lse = lse

    def output_view(self) -> torch.Tensor | None:
        """The output slot as a host tensor ``[rows, Hq, D]`` (rows = batch * m) to write
        the output into directly, where the region allows views (`OutputSlot.tensor`);
        None otherwise. `reply` then skips the copy of an output already there."""
        view = None if self.out is None else self.out.tensor()
        if view is None or view.ndim != 4:
            return None
        b, m, hq, d = view.shape
        return view.view(b * m, hq, d)

    def reply(self, out: torch.Tensor, lse: torch.Tensor | None) -> bytes:
        """Write the outputs into their slots and return the encoded batch reply.

        Args:
            out: ``[batch, m, num_q_heads, head_dim]``, the query's dtype (the shape and
                dtype the slot was checked for).
            lse: float32 ``[batch, m, num_q_heads]``, or None without return_lse.
        """
        out_to = lse_to = None
        if self.out is not None:
            self.out.write(out)
            out_to = (self.out.region_id, self.out.offset)
        if self.lse is not None and lse is not None:
            self.lse.write(lse)
            lse_to = (self.lse.region_id, self.lse.offset)
        return encode_batch_result(out, lse, out_to=out_to, lse_to=lse_to)

    def close(self) -> None:
        """Release the slots (the regions may be unmapped from now on)."""
        for slot in (self.out, self.lse):
            if slot is not None:
                slot.close()

    def __enter__(self) -> SharedOutputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shared_outputs(
    regions: SharedRegions,
    tenant: str,
    request: Any,
    query_shape: torch.Size,
    dtype: torch.dtype,
) -> SharedOutputs:
    """The checked slots a batch request asks its outputs to go to; no slots when it asks
    for none (the usual bytes reply).

    Args:
        regions: the server's registry.
        tenant: the caller's.
        request: an AppendAttendBatchRequest or AttendBatchRequest.
        query_shape: the decoded query's shape ``[batch, m, num_q_heads, head_dim]``: the
            output's; the lse's is its first three sizes.
        dtype: the query's dtype (the output's).

    Raises:
        InvalidRequest: lse_to without return_lse; output_to and lse_to overlap; a range
            that is misaligned or outside its region (naming the field).
        SharedRegionNotFound: an unknown region, or another tenant's.
    """
    want_out = request.HasField("output_to")
    want_lse = request.HasField("lse_to")
    if not (want_out or want_lse):
        return _BYTES
    if want_lse and not request.return_lse:
        raise InvalidRequest("lse_to is set but return_lse is false: no lse to write")
    out = lse = None
    try:
        if want_out:
            to = request.output_to
            out = regions.check_writable(
                tenant, to.region_id, to.offset, dtype, query_shape, "output_to"
            )
        if want_lse:
            to = request.lse_to
            lse = regions.check_writable(
                tenant, to.region_id, to.offset, torch.float32, query_shape[:3], "lse_to"
            )
        if out is not None and lse is not None and _overlap(out, lse):
            raise InvalidRequest(
                f"output_to ({out.nbytes} bytes at offset {out.offset}) and lse_to "
                f"({lse.nbytes} bytes at offset {lse.offset}) overlap in one region"
            )
    except BaseException:
        SharedOutputs(out, lse).close()
        raise
    return SharedOutputs(out, lse)


# The outputs of a request that names no slots: its reply carries bytes (nothing to close).
_BYTES = SharedOutputs(None, None)


def _overlap(a: OutputSlot, b: OutputSlot) -> bool:
    return (
        a.region_id == b.region_id
        and a.offset < b.offset + b.nbytes
        and b.offset < a.offset + a.nbytes
    )


def batch_reply(result: Any, query_shape: torch.Size, outputs: SharedOutputs) -> bytes:
    """The encoded batch reply of a coordinator result (out ``[b * m, Hq, D]``, lse
    ``[b * m, Hq]`` or None): the output as ``[batch, m, num_q_heads, head_dim]`` (and lse
    ``[batch, m, num_q_heads]``), written into the client's region first where the request
    asked for it (`outputs`)."""
    out = result.out.reshape(query_shape)
    lse = None if result.lse is None else result.lse.reshape(query_shape[:3])
    return outputs.reply(out, lse)
