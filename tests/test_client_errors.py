"""The client's error classes: one per status a call can fail with, all public."""

from __future__ import annotations

import grpc
import pytest

import cache_service.client as client
from cache_service.client import sdk
from cache_service.client.errors import STATUS_ERRORS, error_for


def test_the_package_exports_what_the_sdk_exports() -> None:
    assert sorted(client.__all__) == sorted(sdk.__all__)
    for name in client.__all__:
        assert getattr(client, name) is getattr(sdk, name)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.ALREADY_EXISTS, client.AlreadyAppliedError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, client.DeadlineExceededError),
        (grpc.StatusCode.INVALID_ARGUMENT, client.InvalidArgumentError),
        (grpc.StatusCode.DATA_LOSS, client.DataLossError),
        (grpc.StatusCode.UNKNOWN, client.InternalError),
    ],
)
def test_each_status_gets_its_class(code: grpc.StatusCode, cls: type) -> None:
    err = error_for(code, "what went wrong")
    assert type(err) is cls
    assert isinstance(err, client.KVCacheError)
    assert err.code == code
    assert "what went wrong" in str(err)


def test_every_mapped_class_is_public() -> None:
    for cls in set(STATUS_ERRORS.values()):
        assert cls.__name__ in client.__all__
