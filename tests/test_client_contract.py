"""The client SDK (clients/python) stays in step with the committed openapi.json.

- Every operation in the document has exactly one method on the sync client and one on the
  async client (tagged with its operationId), at the document's method and path.
- The sync and async methods are the same: names, parameters, defaults, return types.
- Each method takes every path, query and header parameter of its operation, and exactly
  the fields of its request body, a field required by the schema without a default.
- Each method returns the type the operation's 2xx answer documents.
- Each response model has exactly the schema's fields, required where the schema requires
  them, with matching types; the enumerations hold the schema's values.

openapi.json itself is checked against the server's routes by test_foundation.py, so a
route changed on the server fails here until the SDK follows.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

import trainyard_client
from trainyard_client import _async, _sync
from trainyard_client import _calls as calls
from trainyard_client import models as m

ROOT = Path(__file__).resolve().parents[1]
SPEC = json.loads((ROOT / "openapi.json").read_text())
SCHEMAS = SPEC["components"]["schemas"]

# Parameters the SDK takes under another name, per operation prefix: the models' routes
# name the model `{name}`; its sub-resources call it `model`, as the job bodies do. A run's
# routes name it `{run_id}` or `{job_id}`; what every kind of job shares takes `job_id`.
RENAMED = {"Idempotency-Key": {"idempotency_key"}, "if-match": {"if_match"}}
RENAMED_UNDER = {
    "checkpoints-": {"name": {"model"}},
    "runs-": {"run_id": {"run_id", "job_id"}},
    # `from` is a Python keyword: the client takes the window as since / until.
    "usage-": {"from": {"since"}, "to": {"until"}},
}
# Set by the client itself: the stream resumes with Last-Event-ID after a reconnection.
INTERNAL = {"Last-Event-ID"}


def operations_in_spec() -> dict[str, tuple[str, str, dict[str, Any]]]:
    found = {}
    for path, methods in SPEC["paths"].items():
        for method, op in methods.items():
            found[op["operationId"]] = (method.upper(), path, op)
    return found


def resources(client: Any) -> dict[str, type]:
    """The client's class and its resources' classes (`models`, `training_jobs`, ...)."""
    found: dict[str, type] = {"": type(client)}
    for attribute, value in vars(client).items():
        if isinstance(value, _sync._Resource | _async._Resource):
            found[attribute] = type(value)
    return found


def tagged_methods(client: Any) -> dict[str, tuple[type, str, Any]]:
    """operationId → (class, method name, function) over the client and its resources."""
    found: dict[str, tuple[type, str, Any]] = {}
    for resource in resources(client).values():
        for name, function in inspect.getmembers(resource, inspect.isfunction):
            operation = getattr(function, "__operation__", None)
            if operation is None:
                continue
            if "{jobs}" in operation:
                operation = operation.format(jobs=calls._prefix(resource.kind))
            assert operation not in found, f"{operation} on two methods"
            found[operation] = (resource, name, function)
    return found


SYNC_CLIENT = _sync.Trainyard("http://127.0.0.1:9")
ASYNC_CLIENT = _async.AsyncTrainyard("http://127.0.0.1:9")
SYNC = tagged_methods(SYNC_CLIENT)
ASYNC = tagged_methods(ASYNC_CLIENT)
OPERATIONS = operations_in_spec()


def test_the_operation_table_is_the_documents() -> None:
    assert {op: (method, path) for op, (method, path, _) in OPERATIONS.items()} == calls.OPERATIONS


@pytest.mark.parametrize("client", [SYNC, ASYNC], ids=["sync", "async"])
def test_every_operation_has_a_method(client: dict[str, Any]) -> None:
    assert set(client) == set(OPERATIONS), set(client) ^ set(OPERATIONS)


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_sync_and_async_methods_are_the_same(operation: str) -> None:
    sync_resource, sync_name, sync_function = SYNC[operation]
    async_resource, async_name, async_function = ASYNC[operation]
    async_class = async_resource.__name__.replace("AsyncTrainyard", "Trainyard")
    assert (sync_resource.__name__, sync_name) == (async_class, async_name)
    sync_signature = inspect.signature(sync_function)
    async_signature = inspect.signature(async_function)
    assert sync_signature.parameters == async_signature.parameters
    returns = (sync_signature.return_annotation, async_signature.return_annotation)
    if inspect.isasyncgenfunction(async_function):
        assert returns == ("Iterator[m.JobEvent]", "AsyncIterator[m.JobEvent]")
    else:
        assert inspect.iscoroutinefunction(async_function), async_name
        assert returns[0] == returns[1]


def test_every_public_method_has_its_async_twin() -> None:
    sync_classes, async_classes = resources(SYNC_CLIENT), resources(ASYNC_CLIENT)
    assert set(sync_classes) == set(async_classes)
    for attribute, sync_class in sync_classes.items():
        async_class = async_classes[attribute]
        public = {n for n in dir(sync_class) if not n.startswith("_")}
        twins = {n for n in dir(async_class) if not n.startswith("_")}
        assert public - {"close"} == twins - {"aclose"}, attribute
        for name in public - {"close"}:
            sync_method = getattr(sync_class, name)
            if inspect.isfunction(sync_method):
                async_method = getattr(async_class, name)
                assert inspect.signature(sync_method).parameters == (
                    inspect.signature(async_method).parameters
                ), f"{sync_class.__name__}.{name}"


def _parameter_names(operation: str, op: dict[str, Any], taken: set[str]) -> set[str]:
    """The operation's parameters, by the name the method takes each under."""
    renamed = dict(RENAMED)
    for prefix, names in RENAMED_UNDER.items():
        if operation.startswith(prefix):
            renamed.update(names)
    wanted = set()
    for parameter in op.get("parameters", []):
        if parameter["name"] in INTERNAL:
            continue
        names = renamed.get(parameter["name"], {parameter["name"]})
        wanted.add(next(iter(sorted(names & taken))) if names & taken else parameter["name"])
    return wanted


def _body_schema(body: dict[str, Any]) -> dict[str, Any]:
    """A request body's schema; one of several (a training job's, by `method`): every
    field of each, required where each requires it."""
    if "oneOf" not in body:
        return SCHEMAS[body["$ref"].rsplit("/", 1)[1]] if "$ref" in body else body
    variants = [SCHEMAS[v["$ref"].rsplit("/", 1)[1]] for v in body["oneOf"]]
    required = set.intersection(*(set(v.get("required", [])) for v in variants))
    properties = {k: p for v in variants for k, p in v["properties"].items()}
    return {"properties": properties, "required": sorted(required)}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_methods_take_the_operations_parameters_and_body_fields(operation: str) -> None:
    op = OPERATIONS[operation][2]
    _, name, function = SYNC[operation]
    taken = inspect.signature(function).parameters
    wanted = _parameter_names(operation, op, set(taken))
    assert wanted <= set(taken), f"{name} lacks {wanted - set(taken)}"
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body is None:
        return
    schema = _body_schema(body)
    fields = {
        n: p
        for n, p in taken.items()
        if n != "self" and n not in wanted and p.kind is not inspect.Parameter.VAR_KEYWORD
    }
    if len(fields) < len(taken) - len(wanted) - 1:
        # The gateway's method names OpenAI's required fields and passes the rest through.
        assert set(fields) <= set(schema["properties"]), f"{name}: {set(fields)} vs schema"
        assert set(schema.get("required", [])) <= set(fields)
    else:
        assert set(fields) == set(schema["properties"]), f"{name}: {set(fields)} vs schema"
    for field, parameter in fields.items():
        required = field in schema.get("required", [])
        has_default = parameter.default is not inspect.Parameter.empty
        assert required != has_default, f"{name}({field}): required={required}"


def _component(ref: str) -> Any:
    """The SDK's type for a schema, by its name or `$ref`."""
    name = ref.rsplit("/", 1)[-1]
    if name.startswith("Page_"):
        return m.Page[getattr(m, name.removeprefix("Page_").removesuffix("_"))]
    return getattr(m, name)


def _documented_return(op: dict[str, Any]) -> Any:
    answers = {k: v for k, v in op["responses"].items() if k.startswith("2")}
    if set(answers) == {"204"}:
        return None
    content = next(iter(answers.values())).get("content", {})
    if "text/event-stream" in content:
        return Iterator[m.JobEvent]
    if "application/octet-stream" in content:
        return int  # written to a file: the client returns the bytes written
    if "text/plain" in content:
        return str
    schema = content.get("application/json", {}).get("schema", {})
    if "$ref" in schema:
        reference = schema["$ref"].rsplit("/", 1)[1]
        # The NAT collection stays plain JSON: the client reads it, never builds one.
        return dict[str, Any] if reference == "TrajectoryCollection" else _component(reference)
    if schema.get("type") == "array":
        return list[_component(schema["items"]["$ref"])]
    return dict[str, Any]  # free-form (the gateway's, or either of two trajectory shapes)


def _resolved_return(resource: type, function: Any) -> Any:
    hints = typing.get_type_hints(function)
    returned = hints["return"]
    if returned is type(None):
        return None
    job_type = {
        "training": m.TrainingJob,
        "rollout": m.RolloutJob,
        "evaluation": m.EvaluationJob,
        "run": m.Run,
    }.get(getattr(resource, "kind", ""))
    if isinstance(returned, TypeVar):
        return job_type
    if get_origin(returned) is None and getattr(returned, "__pydantic_generic_metadata__", None):
        meta = returned.__pydantic_generic_metadata__
        if meta["args"] and isinstance(meta["args"][0], TypeVar):
            return m.Page[job_type]
    return returned


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_methods_return_what_the_operation_documents(operation: str) -> None:
    resource, name, function = SYNC[operation]
    documented = _documented_return(OPERATIONS[operation][2])
    assert _resolved_return(resource, function) == documented, name


# --------------------------------------------------------------------------- models


def _shape_of_schema(schema: dict[str, Any]) -> Any:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        target = SCHEMAS[name]
        if "enum" in target:
            return "str"
        return name
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        shapes = tuple(sorted(map(str, (_shape_of_schema(s) for s in options))))
        inner = shapes[0] if len(shapes) == 1 else ("union", shapes)
        return ("optional", inner) if len(options) < len(schema["anyOf"]) else inner
    kind = schema.get("type")
    if kind == "string":
        # An enumeration too: the SDK keeps values a newer server may add.
        return "datetime" if schema.get("format") == "date-time" else "str"
    if kind == "integer":
        return "int"
    if kind == "number":
        return "float"
    if kind == "boolean":
        return "bool"
    if kind == "array":
        return ("list", _shape_of_schema(schema["items"]))
    if kind == "object":
        values = schema.get("additionalProperties", True)
        return ("dict", "any" if values is True else _shape_of_schema(values))
    return "any"


def _shape_of_type(annotation: Any) -> Any:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        shapes = tuple(sorted(map(str, (_shape_of_type(a) for a in options))))
        inner = shapes[0] if len(shapes) == 1 else ("union", shapes)
        return ("optional", inner) if len(options) < len(args) else inner
    if origin is list:
        return ("list", _shape_of_type(args[0]))
    if origin is dict:
        return ("dict", "any" if args[1] is Any else _shape_of_type(args[1]))
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.__name__.replace("[", "_").replace("]", "_")
    return {str: "str", int: "int", float: "float", bool: "bool", datetime: "datetime"}[annotation]


def _model_pairs() -> list[tuple[str, type[BaseModel]]]:
    pairs = []
    for name, value in vars(m).items():
        if isinstance(value, type) and issubclass(value, BaseModel) and name in SCHEMAS:
            pairs.append((name, value))
    for name in SCHEMAS:
        if name.startswith("Page_"):
            pairs.append((name, _component(name)))
    return sorted(pairs, key=lambda pair: pair[0])


MODELS = _model_pairs()
STATUS_ENUMS = {"JobStatus": m.JobStatus, "EventType": m.EventType}


def test_every_response_schema_has_a_model() -> None:
    returned = set()
    for _, _, op in OPERATIONS.values():
        for answer in op["responses"].values():
            schema = answer.get("content", {}).get("application/json", {}).get("schema", {})
            for ref in [schema.get("$ref"), schema.get("items", {}).get("$ref")]:
                if ref:
                    returned.add(ref.rsplit("/", 1)[1])
    # Request-only, or a shape the client hands back as plain JSON.
    returned -= {"TrajectoryCollection", "Problem"}
    modelled = {name for name, _ in MODELS}
    assert returned <= modelled, returned - modelled
    # Nested models: every $ref a modelled schema reaches is modelled too.
    for name in modelled:
        text = json.dumps(SCHEMAS[name])
        for ref in {r.split('"')[0] for r in text.split("#/components/schemas/")[1:]}:
            assert ref in modelled or ref in STATUS_ENUMS, f"{name} → {ref}"


@pytest.mark.parametrize(("name", "model"), MODELS, ids=[n for n, _ in MODELS])
def test_models_have_the_schemas_fields_and_types(name: str, model: type[BaseModel]) -> None:
    schema = SCHEMAS[name]
    fields = model.model_fields
    assert set(fields) == set(schema["properties"]), set(fields) ^ set(schema["properties"])
    for field, info in fields.items():
        required = field in schema.get("required", [])
        assert info.is_required() == required, f"{name}.{field}: required={required}"
        assert _shape_of_type(info.annotation) == _shape_of_schema(schema["properties"][field]), (
            f"{name}.{field}"
        )


@pytest.mark.parametrize("name", sorted(STATUS_ENUMS))
def test_enumerations_hold_the_schemas_values(name: str) -> None:
    assert [member.value for member in STATUS_ENUMS[name]] == SCHEMAS[name]["enum"]


def test_final_events_are_the_ends_of_each_kind() -> None:
    ends = {t for t in SCHEMAS["EventType"]["enum"] if t.endswith(("_ended", "_failed"))}
    assert ends | {"job_cancelled"} == m.FINAL_EVENTS


def test_the_package_exports_its_clients_and_errors() -> None:
    assert trainyard_client.Trainyard is _sync.Trainyard
    assert trainyard_client.AsyncTrainyard is _async.AsyncTrainyard
    assert issubclass(trainyard_client.ValidationError, trainyard_client.APIError)
