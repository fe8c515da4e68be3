"""Errors gRPC makes up on the client side name the service and its address (an asyncio channel
from services.common.client), against a port where nothing listens and a real server that is
too slow for the call's deadline."""

import asyncio

import grpc
import pytest

from rlmesh.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.client import make_channel, returned_by_service
from tests.common.test_server import ECHO, start_echo
from tests.conftest import get_free_port


def test_nothing_listening_names_the_service_and_address():
    address = f"127.0.0.1:{get_free_port()}"

    async def call():
        async with make_channel(address, "rlmesh.learner.v1.LearnerService", idempotent_methods=("GetInfo",)) as ch:
            return await learner_pb2_grpc.LearnerServiceStub(ch).GetInfo(learner_pb2.GetInfoRequest(), timeout=10)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(call())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and not returned_by_service(err.value)
    assert err.value.details().startswith(f"learner service at {address} is unavailable: ")
    assert "Connection refused" in err.value.details()


def test_deadline_names_the_service_and_the_answer_still_arrives_unchanged(tmp_path):
    proc, info = start_echo(tmp_path)

    async def calls():
        async with make_channel(info["address"], "rlmesh.test.Echo") as ch:
            echo = ch.unary_unary(ECHO)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await echo(b"00002000", timeout=0.3)
            return err.value, await echo(b"00000000ok", timeout=10)

    try:
        error, answer = asyncio.run(calls())
    finally:
        proc.terminate()
        proc.wait(30)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.details().startswith(f"echo service at {info['address']} did not answer within the call's deadline")
    assert answer == b"00000000ok"
