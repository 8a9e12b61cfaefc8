"""Which gRPC status each error becomes."""

from __future__ import annotations

import grpc
import pytest

from cache_service import errors as ce
from cache_service.api.status_mapping import status_for
from cache_service.engine.attention_plan import AttentionPlanError
from cache_service.engine.errors import ServiceUnavailable, WorkerLost
from cache_service.wire.tensor_codec import TensorCodecError
from workers import errors as we

C = grpc.StatusCode


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ce.SequenceNotFound("no sequence 'x' for this tenant"), C.NOT_FOUND),
        (ce.InvalidRequest("token ids must be ints"), C.INVALID_ARGUMENT),
        (ce.LayerNotWritten("layer 3 has nothing written"), C.FAILED_PRECONDITION),
        (ce.QuotaExceeded("tenant 'a' holds 10 blocks"), C.RESOURCE_EXHAUSTED),
        (ce.PoolExhausted("need 4 more blocks"), C.RESOURCE_EXHAUSTED),
        (ce.SequenceLost("sequence 'x' lost its KV blocks"), C.DATA_LOSS),
        (TensorCodecError("items[0].key: 3 bytes"), C.INVALID_ARGUMENT),
        (AttentionPlanError("num_queries[0] must be"), C.INVALID_ARGUMENT),
        (we.InvalidWorkerRequest("slot 99 out of range"), C.INVALID_ARGUMENT),
        (WorkerLost("w1", ["s1"], "it restarted with an empty pool"), C.DATA_LOSS),
        (we.StaleEpochError("w1", "a", "b"), C.DATA_LOSS),
        (ServiceUnavailable("no worker is serving"), C.UNAVAILABLE),
        (we.WorkerUnavailable("w1", "actor died"), C.UNAVAILABLE),
    ],
)
def test_known_errors_keep_their_message(exc: Exception, code: grpc.StatusCode) -> None:
    status = status_for(exc)
    assert status.code == code and not status.internal
    assert str(exc) in status.message


def test_other_tenants_sequences_look_unknown() -> None:
    status = status_for(ce.PermissionDenied("sequence 'x' belongs to tenant 'b'"))
    assert status.code == C.NOT_FOUND
    assert "tenant" not in status.message.replace("not yours", "")


def test_unexpected_errors_are_internal_and_carry_a_reference_not_the_details() -> None:
    status = status_for(KeyError("secret internal detail"))
    assert status.code == C.INTERNAL and status.internal
    assert "secret" not in status.message and "ref=" in status.message


def test_lost_worker_message_says_what_to_do() -> None:
    message = status_for(WorkerLost("w1", ["s1", "s2"], "actor died")).message
    assert "w1" in message and "['s1', 's2']" in message and "recompute" in message
