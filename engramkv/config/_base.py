"""The base of every config model: unknown fields and invalid assignments are errors."""

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
