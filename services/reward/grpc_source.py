"""Remote gRPC reward servers: any server of rlmesh.reward.v1.RewardService (e.g. one built with
services.reward.function_server), called with the same batching, timeout and retry policy as
HTTP servers (RemoteSource).

UNAVAILABLE and an expired per-call deadline are retried like connection errors and timeouts over
HTTP; Score is idempotent, so a repeated call is harmless. Any other status ends the batch with the
remote's code and message.
"""

from __future__ import annotations

import grpc

from rlmesh.reward.v1 import reward_pb2_grpc
from services.common.client import make_channel
from services.common.security import ClientCredentials
from services.reward.client import REWARD_SERVICE, score_request, scores_from_response
from services.reward.remote import FinalError, RemotePolicy, RemoteSource, RetryableError
from services.reward.source import ScoreBatch, SourceScores

SCHEME = "grpc://"


class GrpcRewardSource(RemoteSource):
    """Scores batches by calling Score on one or more gRPC reward servers (grpc://host:port)."""

    kind = "grpc"

    def __init__(self, urls: list[str], policy: RemotePolicy, max_message_mb: int = 256,
                 tls_ca: str = "", seed: int | None = None):
        super().__init__(urls, policy, seed)
        self.max_message_mb = max_message_mb
        self.tls_ca = tls_ca
        self._stubs: dict[str, reward_pb2_grpc.RewardServiceStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    async def start(self) -> None:
        await super().start()
        for endpoint in self.endpoints:
            if endpoint.address in self._stubs:
                continue
            # No channel-level retries: RemotePolicy retries, and two layers would multiply attempts.
            # Empty credentials: a server outside the run never gets the run's token.
            channel = make_channel(endpoint.address.removeprefix(SCHEME), REWARD_SERVICE,
                                   default_timeout_s=self.policy.timeout_s, max_message_mb=self.max_message_mb,
                                   tls_ca=self.tls_ca, credentials=ClientCredentials())
            self._channels.append(channel)
            self._stubs[endpoint.address] = reward_pb2_grpc.RewardServiceStub(channel)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()

    async def call(self, address: str, chunk: ScoreBatch, offset: int) -> SourceScores:
        try:
            response = await self._stubs[address].Score(score_request(chunk), timeout=self.policy.timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                raise RetryableError("connection_error", f"{address}: UNAVAILABLE: {exc.details()}") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RetryableError("timeout", f"{address}: no answer within --remote_rm_timeout_s "
                                                f"{self.policy.timeout_s:g} s") from None
            raise FinalError("grpc_error", f"remote reward server {address} answered {code.name} (not retried): "
                                           f"{exc.details()}", code) from None
        return scores_from_response(response, len(chunk), offset)
