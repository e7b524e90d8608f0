"""The base of every config model: frozen pydantic models that refuse unknown keys.

Frozen models hash by value, so a config can be a static argument of jitted functions. Validation
errors are `pydantic.ValidationError` (a ValueError); trainer/config.py words them for users.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, StrictBool, StrictInt
from pydantic_core import PydanticCustomError

__all__ = ["Flag", "Integer", "Number", "Section"]


class Section(BaseModel):
    """Integers and flags are strict (no 'true' for 1, no 2.0 for 2); numbers are finite."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, coerce_numbers_to_str=True)


def _not_a_flag(value: Any) -> Any:
    """pydantic reads true as 1.0; a number field takes numbers (and numeric text, as YAML 1.1 leaves '1e-3')."""
    if isinstance(value, bool):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


Integer = StrictInt
Flag = StrictBool
Number = Annotated[float, BeforeValidator(_not_a_flag)]
