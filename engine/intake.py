"""What both engines' front doors (sluice.engine.llm.LLM, sluice.engine.embedding_engine.EmbeddingEngine) share: the
requests in flight by id, and those refused at the door, handed back by the next ``step()`` as error
outputs so that a bad request fails alone."""

from __future__ import annotations

from typing import Generic, TypeVar

State = TypeVar("State")
Out = TypeVar("Out")


class Intake(Generic[State, Out]):
    def __init__(self) -> None:
        self.requests: dict[str, State] = {}
        self._rejected: list[Out] = []

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._rejected)

    def _in_flight(self, request_id: str) -> bool:
        return request_id in self.requests

    def _check_new(self, request_id: str) -> None:
        if self._in_flight(request_id):
            raise ValueError(f"request id {request_id!r} is already in flight")

    def _reject(self, out: Out) -> None:
        self._rejected.append(out)

    def _take_rejected(self) -> list[Out]:
        done, self._rejected = self._rejected, []
        return done
