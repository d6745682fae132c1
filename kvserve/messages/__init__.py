"""Typed messages, one module per socket link: `frontend_runner` and `runner_memsvc`.
They describe the wire; they know nothing about what the processes do with them."""
