"""HTTP routes of stepserve's own API: thin handlers over :mod:`service.api.pipeline`."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.api import pipeline
from service.api.errors import ERRORS, ApiError, Shape
from service.api.schemas import ErrorBody, InferChunk, InferRequest, InferResponse, ModelCard, ModelList
from service.api.state import State
from service.engine.sequence import FinalEvent, TokenEvent

router = APIRouter()


def _end(final: FinalEvent) -> dict:
    """The fields of a request's end: finish_reason, error, usage and timings (seconds)."""
    return {
        "finish_reason": final.finish_reason.value,
        "error": final.error,
        "usage": {
            "prompt_tokens": final.prompt_tokens,
            "completion_tokens": final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
        },
        "timings": {
            "queue_s": final.queue_s,
            "ttft_s": final.ttft_s,
            "decode_s": final.decode_s,
            "total_s": final.total_s,
        },
    }


class InferFormat:
    """``/infer`` answers: :class:`InferResponse`, or :class:`InferChunk` events. A request
    that had produced tokens when its time limit or a shutdown ended it answers 200 with
    ``finish_reason`` ``timeout`` or ``cancelled`` and the reason in ``error``."""

    done_marker = False
    partial_ends = True
    shape: Shape = "openai"
    named_events = False

    def __init__(self, request_id: str, model: str, tokenizer=None, logprobs: bool = False):
        self.id, self.model, self._tokenizer, self._logprobs = request_id, model, tokenizer, logprobs
        self._entries: list[dict] = []

    def _lp(self, entries) -> list[dict]:
        decode = self._tokenizer.tokenizer.decode if self._tokenizer is not None else None

        def text(i: int) -> str:
            return decode([i], skip_special_tokens=False) if decode else str(i)

        return [
            {
                "token_id": e.token_id,
                "token": text(e.token_id),
                "logprob": e.logprob,
                "top_logprobs": [{"token_id": i, "token": text(i), "logprob": lp} for i, lp in e.top],
            }
            for e in entries
        ]

    def chunks(self, text: str, logprobs=(), tokens: int | None = None) -> list[dict]:
        chunk = InferChunk(id=self.id, model=self.model, text=text).model_dump(exclude_none=True)
        if self._logprobs:
            chunk["logprobs"] = self._lp(logprobs)
        return [chunk]

    def add(self, event: TokenEvent) -> None:
        """Keep a non-streamed answer's logprobs (``body`` returns them)."""
        self._entries += self._lp(event.logprobs) if self._logprobs else []

    def final_chunks(self, final: FinalEvent) -> list[dict]:
        return [InferChunk.model_validate({"id": self.id, "model": self.model, "text": "", **_end(final)}).model_dump()]

    def error_chunks(self, error: ApiError) -> list[dict]:
        """The error object as the stream's last event."""
        return [error.body(self.shape)]

    def body(self, text: str, final: FinalEvent) -> dict:
        body = InferResponse.model_validate({"id": self.id, "model": self.model, "text": text, **_end(final)})
        out = body.model_dump()
        if self._logprobs:
            out["logprobs"] = self._entries
        return out


@router.post("/infer", response_model=InferResponse, responses={**ERRORS, 200: {"content": {"text/event-stream": {}}}})
async def infer(body: InferRequest, request: Request, state: State):
    """Generate a completion for a prompt or a chat; ``stream`` answers server-sent events
    (:class:`InferChunk`). ``finish_reason``: ``stop``, ``length``, and ``timeout`` or
    ``cancelled`` (with ``error``) for a request ended early after its first token; ended
    before it, the request answers 504 or 503."""
    engine = await pipeline.resolve_engine(state, body.model)
    pipeline.check_messages(body.messages or [])
    messages = [m.for_template() for m in body.messages] if body.messages is not None else None
    ids = await pipeline.prompt_ids(engine, body.prompt, messages)
    params = pipeline.sampling_params(
        engine,
        len(ids),
        body.max_tokens or state.settings.default_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(body.stop or ()),
        logprobs=body.logprobs,
        grammar=pipeline.grammar(engine, body.response_format),
        **body.processors(),
    )
    gen = pipeline.start(state, engine, ids, params)
    fmt = InferFormat(gen.seq.request_id, engine.model.name, engine.model.tokenizer, body.logprobs is not None)
    return await pipeline.respond(request, gen, fmt, body.stream)


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: State) -> ModelList:
    """The served models, in OpenAI's list shape, each with its ``state`` (``loaded``,
    ``loading`` or ``unloaded``: :class:`ModelCard`)."""
    return ModelList(
        data=[ModelCard(id=name, created=state.started, state=state.model_state(name)) for name in state.model_names]
    )


@router.get("/healthz")
async def healthz() -> dict:
    """The process is alive (answers during warm-up, generation and drain)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": ErrorBody}})
async def readyz(state: State) -> dict:
    """200 once every model loaded at start-up is warmed up (on-demand models are not waited
    for; those loaded are listed); 503 with the reason before, and while draining.
    Per model, ``warmup`` says what is warm: prompt tokens, concurrent requests and buckets, and
    whether (``reduced``) and why its extent was sized down for this host
    (:class:`service.process.warm_sizing.Coverage`). On a pipeline group's rank 0, ``group``
    lists each rank's layers and memory. ``kv`` says how the KV cache is kept and, for a paged
    pool, how many tokens of KV it holds and how they are used now."""
    if state.draining:
        raise ApiError(503, "not ready: server is shutting down", type="unavailable")
    engines = {name: e for name, e in state.engines.items() if name not in state.on_demand or e.ready.is_set()}
    waiting = {
        name: e.not_ready_reason for name, e in (*engines.items(), *state.embedders.items()) if not e.ready.is_set()
    }
    if len(engines) + len(state.embedders) < len(state.model_names) - len(state.on_demand) or waiting:
        reason = "; ".join(f"{n}: {r}" for n, r in waiting.items()) or "loading models"
        raise ApiError(503, f"not ready: {reason}", type="unavailable")
    return {
        "status": "ready",
        "models": {
            name: {
                "warmup_s": e.warmup_seconds,
                "warmup": {"buckets": e.warmup_buckets, **asdict(coverage)} if coverage else None,
                "warmed": e.warmup_buckets,
                "compiled": sum(c == "compiled" for c in choices.values()),
                "compile": e.compile_policy,
                "buckets": choices,
                "rehearsed": e.rehearsed,
                "speculative": e.speculator.describe() if e.speculator else None,
                "kv": e.kv_summary(),
            }
            for name, e in engines.items()
            for choices, coverage in [(e.compile_choices(), state.coverage.get(name))]
        },
        **(
            {
                "embedding_models": {
                    name: {
                        "warmup_s": e.warmup_seconds,
                        "warmed": e.warmup_buckets,
                        "max_tokens": e.max_tokens,
                        "dimensions": e.model.dimensions,
                        "buckets": e.compile_choices(),
                    }
                    for name, e in state.embedders.items()
                }
            }
            if state.embedders
            else {}
        ),
        **({"group": [asdict(rank) for rank in state.ranks]} if state.ranks else {}),
    }


@router.get("/metrics")
async def metrics(state: State) -> Response:
    """Prometheus text exposition."""
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
