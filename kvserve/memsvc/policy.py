"""Admission policies: how many slots a newly admitted request gets.

`reserve`: prompt + max_new_tokens, so a running request never runs out.
`optimistic`: prompt + a growth chunk; later growth may find the pool exhausted and the
runner preempts. Policies are looked up in `POLICIES` by name.

This module knows nothing about trees, rows or sockets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar


class AdmissionPolicy(ABC):
    """Decides the initial capacity of an admitted request."""

    name: ClassVar[str]

    def __init__(self, grow_chunk: int) -> None:
        self.grow_chunk = grow_chunk

    @abstractmethod
    def admit_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        """Slots to give a request at admission (before page rounding and context clipping).

        Args:
            prompt_len: tokens in the prompt.
            max_new_tokens: the most tokens the request may generate.
        Returns:
            The capacity, at least `prompt_len`.
        """


class ReservePolicy(AdmissionPolicy):
    name = "reserve"

    def admit_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + max_new_tokens


class OptimisticPolicy(AdmissionPolicy):
    name = "optimistic"

    def admit_capacity(self, prompt_len: int, max_new_tokens: int) -> int:
        return prompt_len + min(self.grow_chunk, max_new_tokens)


POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (ReservePolicy, OptimisticPolicy)
}


def make_policy(name: str, grow_chunk: int) -> AdmissionPolicy:
    """The policy called `name`; ValueError listing the known names otherwise."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"policy {name!r} is not one of {', '.join(sorted(POLICIES))}")
    return cls(grow_chunk)
