"""HTTP routes of stepserve's own API: thin handlers over :mod:`service.api.pipeline`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.api import pipeline as generation
from service.api.errors import ApiError
from service.api.schemas import ErrorBody, InferChunk, InferRequest, InferResponse, ModelCard, ModelList
from service.api.state import AppState
from service.engine.sequence import FinalEvent

router = APIRouter()
ERRORS = {code: {"model": ErrorBody} for code in (400, 404, 413, 422, 429, 500, 503, 504)}


def get_state(request: Request) -> AppState:
    return request.app.state.stepserve


State = Annotated[AppState, Depends(get_state)]


class InferFormat:
    """``/infer`` answers: :class:`InferResponse`, or :class:`InferChunk` events."""

    done_marker = False

    def __init__(self, request_id: str, model: str):
        self.id, self.model = request_id, model

    def chunks(self, text: str) -> list[dict]:
        return [InferChunk(id=self.id, model=self.model, text=text).model_dump(exclude_none=True)]

    def final_chunks(self, final: FinalEvent) -> list[dict]:
        usage = {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens}
        chunk = InferChunk(
            id=self.id,
            model=self.model,
            text="",
            finish_reason=final.finish_reason.value,
            usage=usage,
            timings=generation.timings(final),
        )
        return [chunk.model_dump()]

    def body(self, text: str, final: FinalEvent) -> dict:
        return InferResponse(
            id=self.id,
            model=self.model,
            text=text,
            finish_reason=final.finish_reason.value,
            usage={"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens},
            timings=generation.timings(final),
        ).model_dump()


@router.post("/infer", response_model=InferResponse, responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
async def infer(body: InferRequest, request: Request, state: State):
    """Generate a completion for a prompt or a chat; ``stream`` answers server-sent events."""
    engine = generation.resolve_engine(state, body.model)
    messages = [m.model_dump() for m in body.messages] if body.messages is not None else None
    ids = generation.prompt_ids(engine, body.prompt, messages)
    params = generation.sampling_params(
        engine,
        len(ids),
        body.max_tokens or state.settings.default_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(body.stop),
    )
    seq, events = generation.start(state, engine, ids, params)
    return await generation.respond(
        request, engine, seq, events, InferFormat(seq.request_id, engine.model.name), body.stream
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: State) -> ModelList:
    """The served models, in OpenAI's list shape."""
    return ModelList(data=[ModelCard(id=name, created=state.started) for name in state.engines])


@router.get("/healthz")
async def healthz() -> dict:
    """The process is alive (answers during warm-up, generation and drain)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": ErrorBody}})
async def readyz(state: State) -> dict:
    """200 once every model is warmed up; 503 with the reason before, and while draining."""
    if state.draining:
        raise ApiError(503, "not ready: server is shutting down", type="unavailable")
    waiting = {name: e.not_ready_reason for name, e in state.engines.items() if not e.ready.is_set()}
    if not state.engines or waiting:
        reason = "; ".join(f"{n}: {r}" for n, r in waiting.items()) or "loading models"
        raise ApiError(503, f"not ready: {reason}", type="unavailable")
    return {
        "status": "ready",
        "models": {
            name: {
                "warmup_s": e.warmup_seconds,
                "warmed": e.warmup_buckets,
                "compiled": sum(c == "compiled" for c in choices.values()),
                "compile": e.runner.compiled.policy,
                "buckets": choices,
            }
            for name, e in state.engines.items()
            for choices in [e.compile_choices()]
        },
    }


@router.get("/metrics")
async def metrics(state: State) -> Response:
    """Prometheus text exposition."""
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
