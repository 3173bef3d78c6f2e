"""Datasets: examples uploaded once as JSON Lines, read by runs (`app.datasets`)."""

from __future__ import annotations

import email.message
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from app import datasets as dataset_service
from app.api.body import off_the_loop
from app.api.deps import Caller, Cursor, JobId, Session
from app.errors import InvalidInputError, ProblemError
from app.ingest.edge import body_of
from app.schemas.common import FieldError, Page, problem_responses
from app.schemas.runs import Dataset

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=problem_responses(401))

JSONL_TYPES = (
    "application/jsonl",
    "application/x-ndjson",
    "application/x-jsonlines",
    "text/plain",
    "application/octet-stream",
)
EXAMPLE_LINES = (
    '{"id": "q1", "messages": [{"role": "user", "content": "What is 2+2?"}], "expected": "4"}\n'
    '{"id": "v1", "messages": [{"role": "user", "content": "What is 3+3?"}], "expected": "6", '
    '"split": "validation"}\n'
)
DatasetName = Annotated[
    str,
    Query(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}$", description="A name for the dataset."),
]


@router.post(
    "",
    response_model=Dataset,
    status_code=201,
    summary="Upload examples as JSON Lines (one example per line, with its `split`)",
    description="The body is JSON Lines, sent as `application/jsonl`, "
    "`application/x-ndjson`, `text/plain` or `application/octet-stream`: "
    "one rollout example per line (`id`, `messages`, `expected`, `metadata`) with the "
    "`split` it belongs to (default `train`). Every error names its line: "
    "`line[3].messages[0].role`. The same bytes uploaded again under the same name answer "
    "200 with the dataset stored the first time.",
    responses={
        200: {"model": Dataset, "description": "Already stored."},
        **problem_responses(413, 422),
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                media: {
                    "schema": {"type": "string", "description": "JSON Lines"},
                    "example": EXAMPLE_LINES,
                }
                # The one media type OpenAPI generators take for raw bytes; the route also
                # takes the JSON Lines types (`JSONL_TYPES`), as its description says.
                for media in ("application/octet-stream",)
            },
        }
    },
)
async def upload(
    request: Request, response: Response, session: Session, caller: Caller, name: DatasetName
) -> Dataset:
    problem = _jsonl_type_problem(request.headers.get("content-type"))
    if problem is not None:
        raise InvalidInputError("a dataset is uploaded as JSON Lines in UTF-8", errors=[problem])
    raw = await body_of(request)
    depth = request.app.state.settings.max_json_depth

    def read() -> dataset_service.Prepared | ProblemError:
        return dataset_service.read_jsonl(raw, max_depth=depth)

    # The path of large JSON bodies (`read_json`): in a thread, the collector paused.
    outcome = (
        read() if len(raw) <= dataset_service.INLINE_BYTES else await off_the_loop(request, read)
    )
    if isinstance(outcome, ProblemError):
        raise outcome
    dataset, created = await dataset_service.create_dataset(
        session, name=name, prepared=outcome, project_id=caller.owner
    )
    await session.commit()
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/v1/datasets/{dataset.id}"
    return dataset


def _jsonl_type_problem(content_type: str | None) -> FieldError | None:
    """A JSON Lines media type (`JSONL_TYPES`), in UTF-8: a `charset` other than UTF-8 (or
    its subset US-ASCII) is refused, as for JSON bodies."""
    if (content_type or "").split(";")[0].strip().lower() not in JSONL_TYPES:
        return FieldError(
            location="header",
            path="content-type",
            message=f"send one of {', '.join(JSONL_TYPES)}",
            type="content_type",
        )
    message = email.message.Message()
    message["content-type"] = content_type or ""
    charset = message.get_param("charset")
    if charset is not None and (
        not isinstance(charset, str) or charset.lower().replace("-", "") not in ("utf8", "usascii")
    ):
        return FieldError(
            location="header",
            path="content-type",
            message=f"JSON Lines are UTF-8; this body says charset={charset}",
            type="charset",
        )
    return None


@router.get("", name="list", response_model=Page[Dataset], summary="List datasets, newest first")
async def list_datasets(
    session: Session,
    caller: Caller,
    name: Annotated[str | None, Query(max_length=128, pattern=r"^[^\x00]*$")] = None,
    after: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Page[Dataset]:
    items, has_more = await dataset_service.list_datasets(
        session, name=name, after=after, limit=limit, project_id=caller.sees
    )
    return Page(data=items, has_more=has_more, next_cursor=items[-1].id if has_more else None)


@router.get(
    "/{dataset_id}",
    response_model=Dataset,
    summary="Get a dataset",
    responses=problem_responses(404),
)
async def get_dataset(dataset_id: JobId, session: Session, caller: Caller) -> Dataset:
    row = await dataset_service.get_dataset(session, dataset_id, caller.sees)
    return dataset_service.to_wire(row)


@router.delete(
    "/{dataset_id}",
    status_code=204,
    summary="Delete a dataset no active run reads",
    responses=problem_responses(404, 409),
)
async def delete_dataset(dataset_id: JobId, session: Session, caller: Caller) -> Response:
    await dataset_service.delete_dataset(session, dataset_id, caller.sees)
    await session.commit()
    return Response(status_code=204)
