"""The base of every config model: frozen pydantic models that refuse unknown keys.

Frozen models hash by value, so a config can be a static argument of jitted functions. Bounds are
declared on the fields (`Field(ge=1)`). Validation errors are `pydantic.ValidationError` (a ValueError);
`explain` words them for users, once for the trainer's config and the control plane's
(provision/config/loading.py).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

__all__ = ["Flag", "Integer", "NonNegative", "Number", "Positive", "Section", "did_you_mean", "explain", "invalid"]


class Section(BaseModel):
    """Integers and flags are strict (no 'true' for 1, no 2.0 for 2); numbers are finite."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, coerce_numbers_to_str=True)


def _not_a_flag(value: Any) -> Any:
    """pydantic reads true as 1.0; a number field takes numbers (and numeric text, as YAML 1.1 leaves '1e-3')."""
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


Integer = StrictInt
Positive = Annotated[StrictInt, Field(ge=1)]
NonNegative = Annotated[StrictInt, Field(ge=0)]
Flag = StrictBool
Number = Annotated[float, BeforeValidator(_not_a_flag)]


# --- the project's words for pydantic's errors (the control plane's config file and the trainer's) ---

# The kind of every error a validator of ours raises (`invalid`): its message is already the project's.
OWN_ERROR = "moe_tpu"
_BOUND_ERRORS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}
_TYPE_ERRORS = {"int": "an integer", "bool": "true or false", "float": "a number", "finite_number": "a finite number",
                "string": "a string", "model": "a mapping", "dict": "a mapping", "list": "a list"}


def invalid(message: str) -> PydanticCustomError:
    """A validator's error in the project's words (raise it from a field or model validator)."""
    return PydanticCustomError(OWN_ERROR, message)  # type: ignore[arg-type]


def did_you_mean(word: str, choices: list[str], prefix: str = "") -> str:
    """"; did you mean 'CHOICE'?" for the closest of `choices` (named after `prefix`), or ""."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def _bounds(field: FieldInfo | None, error: Mapping[str, Any]) -> dict[str, Any]:
    """The bounds a field declares (Field(ge=..., lt=...)); without the field, the one that failed."""
    found = {name: getattr(item, name) for item in (field.metadata if field else ())
             for name in ("gt", "ge", "lt", "le") if getattr(item, name, None) is not None}
    return found or {_BOUND_ERRORS[error["type"]]: error["ctx"][_BOUND_ERRORS[error["type"]]]}


def bound_text(bounds: Mapping[str, Any]) -> str:
    """{"ge": 1} -> "at least 1", {"ge": 0, "lt": 1} -> "in [0, 1)", {"gt": 0} -> "positive"."""
    low = next(((name, bounds[name]) for name in ("ge", "gt") if name in bounds), None)
    high = next(((name, bounds[name]) for name in ("le", "lt") if name in bounds), None)
    if low and high:
        if low[0] == "ge" and high[0] == "le":
            return f"between {low[1]} and {high[1]}"
        return f"in {'[' if low[0] == 'ge' else '('}{low[1]}, {high[1]}{']' if high[0] == 'le' else ')'}"
    if low:
        if low[1] == 0:
            return "0 or more" if low[0] == "ge" else "positive"
        return f"at least {low[1]}" if low[0] == "ge" else f"greater than {low[1]}"
    assert high is not None
    return f"at most {high[1]}" if high[0] == "le" else f"less than {high[1]}"


def explain(error: Mapping[str, Any], model_at: Callable[[tuple[Any, ...]], type[BaseModel] | None], *,
            show: Callable[[Any], str] = repr, dotted: bool = False) -> str:
    """One pydantic error in the project's words, without the key it is about: the control plane lists the
    dotted key beside it, the trainer puts it first (`describe` in trainer/config.py).

    `model_at(loc)` is the model whose fields a location holds (None: not a model); `show` writes the
    value given; `dotted` names unknown keys and their close matches by their whole dotted key."""
    kind, loc, value = error["type"], tuple(error["loc"]), error.get("input")
    if kind == OWN_ERROR:
        return error["msg"]
    if kind == "extra_forbidden":
        model = model_at(loc[:-1])
        names = [name for name, field in (model.model_fields if model else {}).items() if not field.exclude]
        prefix = "".join(f"{part}." for part in loc[:-1]) if dotted else ""
        hint = did_you_mean(str(loc[-1]), names, prefix) or (f"; valid keys: {', '.join(names)}" if names else "")
        return f"unknown key '{prefix}{loc[-1]}'{hint}"
    if kind == "missing":
        return "missing required key"
    if kind == "literal_error":
        return f"must be one of {error['ctx']['expected']}, got {show(value)}"
    if kind in _BOUND_ERRORS:
        model = model_at(loc[:-1]) if loc else None
        field = model.model_fields.get(str(loc[-1])) if model is not None else None
        why = f" ({field.description})" if field is not None and field.description else ""
        return f"must be {bound_text(_bounds(field, error))}{why}, got {show(value)}"
    what = _TYPE_ERRORS.get(kind.removesuffix("_parsing").removesuffix("_type").removesuffix("_from_float"))
    if what:
        return f"must be {what}, got {show(value)}"
    return f"{error['msg'][0].lower()}{error['msg'][1:]}, got {show(value)}"
