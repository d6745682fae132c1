"""One way to drive a hypothesis state machine until it has sent a given number of frames
(the socket fuzz tests of memsvc, the frontend and the runner promise at least 10,000)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test


def drive(machine: type[RuleBasedStateMachine], sent: dict[str, int], *, frames: int = 10_000,
          examples: int = 40, steps: int = 100) -> None:
    """Run `machine` in rounds of `examples` random runs of up to `steps` rules (no example
    database: every round is new) until `sent["sent"]` reaches `frames`."""
    rounds = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
    while sent["sent"] < frames:
        run_state_machine_as_test(machine, settings=rounds)
