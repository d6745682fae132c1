"""`kvserve serve`: the supervisor that starts, watches, restarts and stops memsvc, the
runners and the frontend. Imports only config, procs, paths and sdnotify: never torch."""
